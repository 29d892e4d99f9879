(function () {
  "use strict";
  var data = JSON.parse(document.getElementById("report-data").textContent);
  var shown = data.runs.map(function () { return true; });
  var state = { x: data.x, smooth: data.smooth };
  var charts = [];
  var DASH = { "-": [], ":": [2, 3], "--": [6, 4], "-.": [6, 3, 2, 3] };
  var XLABEL = { step: "step", time: "wall time", elapsed: "seconds since the run's first step" };

  function smooth(ys, w) {  // model.smooth: TensorBoard's debiased EMA; non-finite values kept as they are
    if (!(w > 0)) return ys;
    var last = 0, n = 0;
    return ys.map(function (y) {
      if (y === null || !isFinite(y)) return y;
      last = last * w + (1 - w) * y; n += 1;
      return last / (1 - Math.pow(w, n));
    });
  }
  function alpha(color, a) {
    return color + ("0" + Math.round(255 * a).toString(16)).slice(-2);
  }
  function num(v) {
    if (v === null || v === undefined || !isFinite(v)) return v === null ? "NaN" : "-";
    return Math.abs(v) >= 1000 ? Math.round(v).toLocaleString("en-US") : String(Number(v.toPrecision(4)));
  }
  function xsOf(points, run) {
    if (state.x === "step") return points[0];
    if (state.x === "time") return points[1];
    return points[1].map(function (t) { return t - run.t0; });
  }
  function markX(run) {
    var m = run.mark;
    if (!m || m.step === null) return null;
    return state.x === "step" ? m.step : state.x === "time" ? m.time : m.time - run.t0;
  }

  function build(panel, host) {
    var tables = [], series = [{
      label: XLABEL[state.x],
      value: state.x === "time" ? "{YYYY}-{MM}-{DD} {HH}:{mm}:{ss}" : function (u, v) { return num(v); }
    }], owner = [null];
    data.runs.forEach(function (run, r) {
      panel.lines.forEach(function (line) {
        var points = line.runs[r];
        if (!points) return;
        var xs = xsOf(points, run), ys = points[2];
        var smoothed = line.smooth && state.smooth > 0;
        var common = { dash: DASH[line.style] || [], show: shown[r], spanGaps: false,
                       value: function (u, v) { return num(v); } };
        if (smoothed) {
          tables.push([xs, ys]); owner.push(r);
          series.push(Object.assign({}, common, { label: run.label + ": " + line.label + " (raw)",
            stroke: alpha(run.color, 0.25 * line.alpha), width: 1, points: { show: false } }));
          ys = smooth(ys, state.smooth);
        }
        tables.push([xs, ys]); owner.push(r);
        series.push(Object.assign({}, common, {
          label: run.label + ": " + line.label + (smoothed ? " (smoothed)" : ""),
          stroke: alpha(run.color, line.alpha), width: line.width,
          points: line.marker ? { show: true, size: 6, fill: run.color } : { show: false }
        }));
      });
    });
    var joined = uPlot.join(tables);
    var y = {};
    if (panel.ylim) y.range = [panel.ylim[0], panel.ylim[1]];
    else if (panel.zero) y.range = function (u, lo, hi) { return [0, hi > 0 ? hi * 1.05 : 1]; };
    var marks = [];
    var opts = {
      width: Math.max(320, host.clientWidth || 900), height: 300,
      series: series,
      scales: { x: { time: state.x === "time" }, y: y },
      axes: [{ label: XLABEL[state.x] }, { label: panel.ylabel, size: 70,
               values: function (u, ticks) { return ticks.map(num); } }],
      cursor: { sync: { key: "openlora-report", setSeries: false } },
      legend: { live: true },
      hooks: { draw: [function (u) {
        marks.forEach(function (m) {
          var x = markX(data.runs[m.run]);
          var pos = x === null ? NaN : u.valToPos(x, "x");
          var inside = shown[m.run] && isFinite(pos) && pos >= 0 && pos <= u.over.clientWidth;
          m.el.style.display = inside ? "" : "none";
          if (inside) m.el.style.left = pos + "px";
        });
      }] }
    };
    var chart = new uPlot(opts, joined, host);
    data.runs.forEach(function (run, r) {  // where a run diverged: on every panel, said on the first
      if (markX(run) === null) return;
      var el = document.createElement("div");
      el.className = "mark";
      el.dataset.run = String(r);
      el.style.borderColor = run.color;
      el.title = run.label + ": " + run.mark.text;
      if (panel.key === data.panels[0].key) {
        var text = document.createElement("span");
        text.style.color = run.color;
        text.textContent = run.mark.text;
        el.appendChild(text);
      }
      chart.over.appendChild(el);
      marks.push({ run: r, el: el });
    });
    chart.redraw(false, false);
    return { chart: chart, owner: owner, host: host };
  }

  function buildServing(panel, host) {  // an adapter's serving: always against the wall time
    var tables = [], series = [{ label: "wall time", value: "{YYYY}-{MM}-{DD} {HH}:{mm}:{ss}" }];
    data.serving.adapters.forEach(function (adapter, a) {
      panel.lines.forEach(function (line) {
        var points = line.adapters[a];
        if (!points) return;
        tables.push([points[0], points[1]]);
        series.push({ label: adapter.label + ": " + line.label, stroke: adapter.color, width: line.width,
                      dash: DASH[line.style] || [], spanGaps: false, points: { show: points[0].length < 3 },
                      value: function (u, v) { return num(v); } });
      });
    });
    var chart = new uPlot({
      width: Math.max(320, host.clientWidth || 600), height: 300, series: series,
      scales: { x: { time: true }, y: { range: function (u, lo, hi) { return [0, hi > 0 ? hi * 1.05 : 1]; } } },
      axes: [{ label: "wall time" }, { label: panel.ylabel, size: 70,
               values: function (u, ticks) { return ticks.map(num); } }],
      cursor: { sync: { key: "openlora-serving", setSeries: false } },
      legend: { live: true }
    }, uPlot.join(tables), host);
    return { chart: chart, owner: [], host: host };
  }

  function buildAll() {
    charts.forEach(function (c) { c.chart.destroy(); });
    charts = data.panels.map(function (panel) {
      return build(panel, document.getElementById("chart-" + panel.key));
    });
    document.body.dataset.charts = String(charts.length);
    if (data.serving) {
      var serving = data.serving.panels.map(function (panel) {
        return buildServing(panel, document.getElementById("chart-" + panel.key));
      });
      document.body.dataset.servingCharts = String(serving.length);
      charts = charts.concat(serving);
    }
  }

  function showRun(r, on) {
    shown[r] = on;
    charts.forEach(function (c) {
      c.owner.forEach(function (owner, i) { if (owner === r) c.chart.setSeries(i, { show: on }); });
      c.chart.redraw(false, false);
    });
  }

  var controls = document.getElementById("controls");
  controls.querySelectorAll("input[name=x]").forEach(function (input) {
    input.checked = input.value === state.x;
    input.addEventListener("change", function () { state.x = input.value; buildAll(); });
  });
  var weight = document.getElementById("smooth"), shownWeight = document.getElementById("smooth-value");
  weight.value = String(state.smooth);
  shownWeight.textContent = state.smooth.toFixed(2);
  weight.addEventListener("input", function () {
    state.smooth = Math.min(0.99, Math.max(0, Number(weight.value)));
    shownWeight.textContent = state.smooth.toFixed(2);
    buildAll();
  });
  controls.querySelectorAll("input[data-run]").forEach(function (input) {
    input.addEventListener("change", function () { showRun(Number(input.dataset.run), input.checked); });
  });
  var resizing = null;
  window.addEventListener("resize", function () {
    clearTimeout(resizing);
    resizing = setTimeout(function () {
      charts.forEach(function (c) { c.chart.setSize({ width: Math.max(320, c.host.clientWidth), height: 300 }); });
    }, 150);
  });
  buildAll();
})();
