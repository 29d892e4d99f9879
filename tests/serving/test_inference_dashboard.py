"""grafana/dashboards/openlora-inference.json: generated, provisioned, drawn with the alerts' thresholds, and
every query on requests recorded with InferenceMetrics and scraped by a real Prometheus.

The server side here is InferenceMetrics itself (``telemetry.inference`` of an in-process
``setup_telemetry``), driven by a thread that plays requests the way a server does: queued, started,
first token, token counts; some failing through the server's fault, some through the client's. The
variables are resolved and the panels run as Grafana's Prometheus datasource does
(tests/support/dashboards.py).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import io
import json
import re
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING

import pytest
import yaml

from openlora_otel import names
from openlora_otel.inference import AdapterOrigin
from openlora_otel.names import INFERENCE_METRICS, REQUEST_DURATION_BUCKETS, TTFT_BUCKETS
from tests.support.dashboards import (
    CLUSTER_DASHBOARD,
    TRAINING_DASHBOARD,
    dashboard,
    http_variable_options,
    panels,
    run_every_query,
    substitute,
)
from tests.support.metrics_paths import METRIC_PATHS
from tests.support.polling import wait_until

if TYPE_CHECKING:
    from openlora_otel import TelemetryConfig
    from tests.support.fake_nvml import FakeGpu
    from tests.support.metrics_paths import MetricsPath

ROOT = Path(__file__).resolve().parents[2]
GRAFANA = ROOT / "grafana"
INFERENCE_DASHBOARD = GRAFANA / "dashboards" / "openlora-inference.json"
RULES = ROOT / "openlora_otel" / "rules" / "openlora.yml"


def builder() -> ModuleType:
    spec = importlib.util.spec_from_file_location("build_dashboard", GRAFANA / "build_dashboard.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def rules() -> list[dict]:
    return [rule for group in yaml.safe_load(RULES.read_text())["groups"] for rule in group["rules"]]


def rule(name: str) -> dict:
    (found,) = [r for r in rules() if r.get("alert") == name or r.get("record") == name]
    return found


# -- the generated file, its structure, its provisioning ----------------------------------------------


def test_committed_inference_dashboard_matches_its_generator() -> None:
    assert INFERENCE_DASHBOARD.read_text() == builder().render_inference(), (
        "run: python grafana/build_dashboard.py"
    )


def test_grafana_provisioning_loads_the_inference_dashboard() -> None:
    # The provider loads every JSON in its path; compose mounts grafana/dashboards there.
    provider = yaml.safe_load((GRAFANA / "provisioning" / "dashboards" / "openlora.yml").read_text())[
        "providers"
    ][0]
    assert provider["type"] == "file"
    compose = yaml.safe_load((ROOT / "collector" / "docker-compose.yml").read_text())
    mounts = [
        volume.split(":")
        for service in compose["services"].values()
        for volume in service.get("volumes", [])
        if isinstance(volume, str)
    ]
    (host_dir,) = [source for source, target, *_ in mounts if target == provider["options"]["path"]]
    mounted = (ROOT / "collector" / host_dir).resolve()
    assert INFERENCE_DASHBOARD.parent == mounted and INFERENCE_DASHBOARD.suffix == ".json"
    uids = [dashboard(path)["uid"] for path in sorted(mounted.glob("*.json"))]
    assert "openlora-inference" in uids and len(uids) == len(set(uids)), uids


def _series_names(expr: str) -> set[str]:
    return set(re.findall(r"\b([a-zA-Z_:][a-zA-Z0-9_:]*)\s*\{", expr)) - {"target_info"}


INFERENCE_SERIES = {spec.prometheus for spec in INFERENCE_METRICS}
RECORDED = {r["record"] for r in rules() if "record" in r}


def test_inference_dashboard_structure() -> None:
    board = dashboard(INFERENCE_DASHBOARD)
    assert board["uid"] not in {dashboard(p)["uid"] for p in (TRAINING_DASHBOARD, CLUSTER_DASHBOARD)}
    ids = [p["id"] for p in board["panels"]]
    assert len(ids) == len(set(ids))
    assert "${DS_" not in INFERENCE_DASHBOARD.read_text() and "__inputs" not in board
    variables = {v["name"]: v for v in board["templating"]["list"]}
    assert list(variables) == ["datasource", "job", "service", "run", "instance", "adapter"]
    training = {v["name"]: v for v in dashboard(TRAINING_DASHBOARD)["templating"]["list"]}
    for shared in ("datasource", "job"):
        assert variables[shared] == training[shared], shared
    assert variables["run"]["regex"] == training["run"]["regex"]
    assert variables["adapter"]["multi"] and variables["adapter"]["includeAll"]
    # Linked with the other openlora dashboards through the shared tag, keeping job and run.
    assert "openlora" in board["tags"] and board["links"] == dashboard(TRAINING_DASHBOARD)["links"]
    titles = [p["title"] for p in panels(INFERENCE_DASHBOARD)]
    assert len(titles) == len(set(titles)), titles
    titles = " / ".join(titles).lower()
    for wanted in (
        "requests/s by adapter",
        "error ratio by error type",
        "request duration p50 / p95 / p99",
        "time to first token p50 / p95 / p99",
        "time per output token",
        "output tokens/s",
        "running and waiting requests",
        "adapters loaded",
        "adapter load time",
    ):
        assert wanted in titles, wanted
    used = set()
    for panel in panels(INFERENCE_DASHBOARD):
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, panel["title"]
        assert panel["fieldConfig"]["defaults"].get("unit"), f"no unit: {panel['title']}"
        for target in panel["targets"]:
            assert target["datasource"]["uid"] == "${datasource}"
            expr = target["expr"]
            # Every series read is filtered by every variable.
            for name in _series_names(expr):
                if ":" in name:  # a series the rules record (the energy row), from inference series
                    assert name in RECORDED, f"{panel['title']}: {name} is no recording rule"
                    assert name in panel["description"], f"{panel['title']}: description does not name {name}"
                    continue
                base = re.sub(r"_(bucket|sum|count)$", "", name)
                assert base in INFERENCE_SERIES, f"{panel['title']}: {name} is not an inference series"
                assert base in panel["description"], f"{panel['title']}: description does not name {base}"
                used.add(base)
            # Every series read is filtered by job, instance and adapter, and joined with the
            # target_info of the selected services and runs.
            selectors = re.findall(r"\b([a-zA-Z_:][a-zA-Z0-9_:]*)\{([^}]*)\}", expr)
            # The service: service_name when pulled, the job when pushed (target_info has no
            # service_name then), so target_info is read twice, once for each.
            infos = [labels for name, labels in selectors if name == "target_info"]
            assert infos and len(infos) % 2 == 0, (panel["title"], expr)
            for pulled, pushed in zip(infos[::2], infos[1::2], strict=True):
                assert 'service_name=~"$service"' in pulled, (panel["title"], infos)
                assert 'service_name="", job=~"$service"' in pushed, (panel["title"], infos)
            for name, labels in selectors:
                wanted = (
                    ('openlora_run_id=~"$run"',)
                    if name == "target_info"
                    else ('job=~"$job"', 'instance=~"$instance"', 'openlora_adapter_name=~"$adapter"')
                )
                for selected in wanted:
                    assert selected in labels, (panel["title"], name, selected)
            if re.search(r"\b(rate|increase)\(", expr):
                assert "[$__rate_interval]" in expr, expr
            if expr.startswith("sort_desc("):
                assert target.get("instant") and panel["type"] == "bargauge", panel["title"]
    assert used == INFERENCE_SERIES, f"series no panel reads: {INFERENCE_SERIES - used}"


def test_the_adapters_table_links_each_training_run_to_the_training_dashboard() -> None:
    (table,) = [p for p in panels(INFERENCE_DASHBOARD) if p["title"] == "Adapters and their training runs"]
    assert table["type"] == "table" and table["targets"][0]["format"] == "table" and table["targets"][0]["instant"]
    headers = table["transformations"][1]["options"]["renameByName"]
    assert set(table["transformations"][0]["options"]["include"]["names"]) == set(headers)
    training = dashboard(TRAINING_DASHBOARD)
    (run,) = [v for v in training["templating"]["list"] if v["name"] == "run"]
    # The training dashboard's run variable takes a run id (its regex's value group).
    assert "openlora_run_id=" in run["regex"] and "(?<value>" in run["regex"]
    linked = {}
    for override in table["fieldConfig"]["overrides"]:
        assert override["matcher"]["id"] == "byName"
        ((prop,),) = [override["properties"]]
        (link,) = prop["value"]
        linked[override["matcher"]["options"]] = link["url"]
    assert linked == {
        headers[label]: f"/d/{training['uid']}?var-run=${{__data.fields.{field}}}&from=now-7d&to=now"
        for label, field in (
            ("openlora_training_run_name", "openlora_training_run_id"),
            ("openlora_training_run_id", "openlora_training_run_id"),
        )
    }
    # The field the link reads is a column the table keeps (a column left out is not in the frame).
    assert "openlora_training_run_id" in table["transformations"][0]["options"]["include"]["names"]


def test_panels_use_the_alerts_thresholds_and_client_errors() -> None:
    module = builder()
    latency = rule("OpenloraInferenceLatencyHigh")["expr"]
    objective = float(re.search(r"p95_5m > ([\d.]+)", latency).group(1))
    assert objective == module.LATENCY_OBJECTIVE_S
    ratio = float(
        re.search(
            r"rate5m / instance:openlora_inference_requests:rate5m > ([\d.]+)",
            rule("OpenloraInferenceErrorRatioHigh")["expr"],
        ).group(1)
    )
    assert ratio == module.ERROR_RATIO_THRESHOLD
    client = re.search(
        r'error_type!~"([^"]+)"', rule("instance:openlora_inference_server_errors:rate5m")["expr"]
    ).group(1)
    assert client == module.CLIENT_ERRORS == names.CLIENT_ERROR_PATTERN
    drawn = {
        panel["title"]: {s["value"] for s in panel["fieldConfig"]["defaults"]["thresholds"]["steps"]} - {None}
        for panel in panels(INFERENCE_DASHBOARD)
        if "thresholds" in panel["fieldConfig"]["defaults"]
    }
    assert drawn == {
        "Server error ratio": {ratio},
        "p95 request duration": {objective},
        "Error ratio by error type": {ratio},
        "Request duration p50 / p95 / p99": {objective},
        "p95 request duration by adapter": {objective},
    }, drawn
    for panel in panels(INFERENCE_DASHBOARD):
        for target in panel["targets"]:
            if "error_type!~" in target["expr"]:
                assert f'error_type!~"{client}"' in target["expr"], panel["title"]


# -- every query on recorded requests, scraped by a real Prometheus ----------------------------------

RUN_ID = "serve-run"
SERVED = ("a1", "a2")  # adapters with traffic; "idle" is loaded and gets none, "old" is unloaded
OUTPUT_TOKENS = 8
JOULES_PER_OUTPUT_TOKEN = 2.0  # what the fake GPU's energy counter rises by per generated token
# One cycle of the traffic: per adapter and the base model, successful requests, then one that
# fails through the client's (a name the server does not serve) and one through the server's (an
# exception escaping the block).
CYCLE = (*SERVED, None, *SERVED, None, "a1", "a1", "a2", "a2")
SERVER_ERROR_EVERY = len(CYCLE)  # the last request of each cycle raises RuntimeError
QUEUE_S, FIRST_TOKEN_S, GENERATE_S = 0.004, 0.012, 0.01
# Where the adapters came from: a1 from a named training run, a2 from one known by its id only,
# "idle" told nothing (an adapter without openlora.json).
ORIGINS = {
    "a1": AdapterOrigin(
        run_id="train-a1", run_name="support-v2", base_model="tiny-llama", base_fingerprint="0123abcd", final_eval_loss=1.25
    ),
    "a2": AdapterOrigin(run_id="train-a2", final_eval_loss=2.5),
    "old": AdapterOrigin(run_id="train-old"),
}


class Traffic:
    """Requests played against ``inference`` in a thread, like a server's handlers, until stopped;
    ``through``: a :class:`WsgiServer` or :class:`GrpcServer` that the same requests go through
    instead, measured by a middleware or the interceptor from the traffic alone."""

    def __init__(self, inference, gpu: FakeGpu | None = None, through: WsgiServer | GrpcServer | None = None) -> None:
        self.inference = inference
        self.gpu = gpu
        self.through = through
        self.stop = threading.Event()
        self.sent = {"ok": 0, "server": 0, "client": 0}
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _one(self, index: int) -> None:
        adapter = CYCLE[index % len(CYCLE)]
        if self.through is not None:
            unserved = index % len(CYCLE) == len(CYCLE) - 2
            fails = index % SERVER_ERROR_EVERY == SERVER_ERROR_EVERY - 1
            outcome = self.through.send("nope" if unserved else adapter, fails)
            if outcome == "ok" and self.gpu is not None:
                self.gpu.energy_j += JOULES_PER_OUTPUT_TOKEN * OUTPUT_TOKENS
            self.sent[outcome] += 1
            return
        if index % len(CYCLE) == len(CYCLE) - 2:
            # A name the server does not serve: counted under "other", the client's fault.
            with self.inference.request("other") as req:
                req.fail("unknown_adapter")
            self.sent["client"] += 1
            return
        try:
            with self.inference.request(adapter, queued=True) as req:
                time.sleep(QUEUE_S)
                req.start()
                time.sleep(FIRST_TOKEN_S)
                req.first_token()
                if index % SERVER_ERROR_EVERY == SERVER_ERROR_EVERY - 1:
                    raise RuntimeError("the model failed")
                time.sleep(GENERATE_S)
                req.tokens(input=20, output=OUTPUT_TOKENS)
                if self.gpu is not None:  # the GPU's energy counter rises with each token generated
                    self.gpu.energy_j += JOULES_PER_OUTPUT_TOKEN * OUTPUT_TOKENS
            self.sent["ok"] += 1
        except RuntimeError:
            self.sent["server"] += 1

    def _run(self) -> None:
        index = 0
        while not self.stop.is_set():
            self._one(index)
            index += 1

    def __enter__(self) -> Traffic:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join(timeout=30)


def served_adapter(model: str) -> str | None:
    """The middlewares' ``adapter`` hook here: the base model's name is the base, a served adapter
    itself, any other name ``other``."""
    from openlora_otel.inference import ADAPTER_OTHER

    if model == "tiny-llama":
        return None
    return model if model in (*SERVED, "idle") else ADAPTER_OTHER


class WsgiServer:
    """A WSGI app that streams its answers (QUEUE_S + FIRST_TOKEN_S to the first token, GENERATE_S to
    the usage chunk), measured by nothing but OpenAIMetricsWSGIMiddleware, called in process as a WSGI
    server calls it. A name it does not serve: 404 ``unknown_adapter``; a request asked to fail: the
    app raises after its first chunk."""

    client_error = "unknown_adapter"

    def __init__(self, telemetry) -> None:
        from openlora_otel.inference.wsgi import OpenAIMetricsWSGIMiddleware

        self.app = OpenAIMetricsWSGIMiddleware(self._app, telemetry, adapter=served_adapter)

    @staticmethod
    def _app(environ: dict, start_response) -> Iterator[bytes] | list[bytes]:
        body = json.loads(environ["wsgi.input"].read(int(environ["CONTENT_LENGTH"])))
        if body["model"] == "nope":
            start_response("404 Not Found", [("Content-Type", "application/json")])
            error = {"message": "no such adapter", "type": "not_found_error", "param": "model", "code": "unknown_adapter"}
            return [json.dumps({"error": error}).encode()]
        start_response("200 OK", [("Content-Type", "text/event-stream")])

        def events() -> Iterator[bytes]:
            time.sleep(QUEUE_S + FIRST_TOKEN_S)
            yield b"data: " + json.dumps({"choices": [{"index": 0, "text": "x"}]}).encode() + b"\n\n"
            if body.get("fail"):
                raise RuntimeError("the model failed")
            time.sleep(GENERATE_S)
            usage = {"prompt_tokens": 20, "completion_tokens": OUTPUT_TOKENS}
            yield b"data: " + json.dumps({"choices": [], "usage": usage}).encode() + b"\n\n"
            yield b"data: [DONE]\n\n"

        return events()

    def send(self, adapter: str | None, fails: bool) -> str:
        model = adapter or "tiny-llama"
        request = json.dumps({"model": model, "prompt": "hi", "stream": True, "fail": fails}).encode()
        environ = {
            "REQUEST_METHOD": "POST", "PATH_INFO": "/v1/completions", "CONTENT_LENGTH": str(len(request)),
            "wsgi.input": io.BytesIO(request),
        }  # fmt: skip
        status: list[str] = []
        answer = self.app(environ, lambda line, headers, exc_info=None: status.append(line))
        try:
            for _ in answer:
                pass
        except RuntimeError:
            return "server"
        finally:
            getattr(answer, "close", lambda: None)()
        return "client" if status[0].startswith("404") else "ok"

    def close(self) -> None:
        pass


class GrpcServer:
    """A real gRPC server on loopback with one server-streaming inference RPC (raw bytes; the adapter
    in the ``x-adapter`` metadata, none for the base model), measured by nothing but
    OpenAIMetricsServerInterceptor, and a real client. A name it does not serve: NOT_FOUND; a request
    asked to fail: the handler raises after its first message."""

    client_error = "NOT_FOUND"
    METHOD = "/llm.Generator/Generate"

    def __init__(self, telemetry) -> None:
        from concurrent.futures import ThreadPoolExecutor

        import grpc

        from openlora_otel.inference.grpc_interceptor import OpenAIMetricsServerInterceptor
        from tests.support.processes import free_port

        self.grpc = grpc
        interceptor = OpenAIMetricsServerInterceptor(
            telemetry, methods={self.METHOD: "text_completion"}, adapter_metadata_key="x-adapter",
            adapter=served_adapter, input_tokens=lambda request: 20, output_tokens=len,
        )  # fmt: skip
        self.server = grpc.server(ThreadPoolExecutor(4), interceptors=[interceptor])
        handler = grpc.unary_stream_rpc_method_handler(self._generate)
        self.server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler("llm.Generator", {"Generate": handler})])
        port = free_port()
        self.server.add_insecure_port(f"127.0.0.1:{port}")
        self.server.start()
        self.channel = grpc.insecure_channel(f"127.0.0.1:{port}")
        self.call = self.channel.unary_stream(self.METHOD)

    def _generate(self, request: bytes, context) -> Iterator[bytes]:
        adapter = dict(context.invocation_metadata()).get("x-adapter")
        if adapter == "nope":
            context.abort(self.grpc.StatusCode.NOT_FOUND, "no such adapter")
        time.sleep(QUEUE_S + FIRST_TOKEN_S)
        yield b"x"  # one token a byte (output_tokens=len)
        if request == b"fail":
            raise RuntimeError("the model failed")
        time.sleep(GENERATE_S)
        yield b"x" * (OUTPUT_TOKENS - 1)

    def send(self, adapter: str | None, fails: bool) -> str:
        metadata = () if adapter is None else (("x-adapter", adapter),)
        try:
            for _ in self.call(b"fail" if fails else b"go", metadata=metadata, timeout=30):
                pass
        except self.grpc.RpcError as exc:
            return "client" if exc.code() is self.grpc.StatusCode.NOT_FOUND else "server"
        return "ok"

    def close(self) -> None:
        self.channel.close()
        self.server.stop(grace=None)


def floor(bounds: tuple[float, ...] | list[float], seconds: float) -> float:
    """The lower edge of the bucket that holds ``seconds``."""
    return max((bound for bound in bounds if bound < seconds), default=0.0)


def value(result: list[dict]) -> float:
    (series,) = result
    return float(series["value"][1])


@pytest.mark.e2e
@METRIC_PATHS
def test_every_inference_query_on_recorded_requests(
    tmp_path, monkeypatch: pytest.MonkeyPatch, path: str, major: int
) -> None:
    """On each path of tests/support/metrics_paths.py: pulled (Prometheus 2.42 and 3.16), through our Collector
    (2.42 and 3.16), straight into Prometheus 3's OTLP receiver. The server's GPU is a fake NVML's, whose
    energy counter rises, for the energy row."""
    from openlora_otel import TelemetryConfig
    from openlora_otel.hardware import nvml
    from tests.support.fake_nvml import FakeNvml, h100s
    from tests.support.metrics_paths import MetricsPath

    cards = h100s(1)
    monkeypatch.setattr(nvml, "load_pynvml_backend", lambda: FakeNvml(cards))

    rules_dir = tmp_path / "rules"
    rules_dir.mkdir()
    (rules_dir / "openlora.yml").write_text(RULES.read_text())
    with MetricsPath(path, major, tmp_path, rule_files=[str(rules_dir / "openlora.yml")]) as metrics:
        if metrics.push:
            config = TelemetryConfig.from_env(metrics.push_env(instance="serve-instance"))
        else:
            config = TelemetryConfig(prometheus_host="127.0.0.1", prometheus_port=0)
        config = dataclasses.replace(config, gpu_metrics="on", gpu_devices="all")
        _check_every_inference_query(metrics, config, cards[0])


@pytest.mark.e2e
@pytest.mark.parametrize("through", ["wsgi", "grpc"])
def test_every_inference_query_over_the_wsgi_middleware_and_the_grpc_interceptor(
    tmp_path, monkeypatch: pytest.MonkeyPatch, through: str
) -> None:
    """The same requests, measured from the traffic alone: through OpenAIMetricsWSGIMiddleware around
    a streaming WSGI app, and through OpenAIMetricsServerInterceptor on a real gRPC server and client;
    pulled by Prometheus 3.16 with the shipped rules. Every panel answers and the alerts' records
    hold as with InferenceMetrics driven by hand (the adapters' loads and the held requests are the
    app's own calls, which a middleware leaves to it)."""
    from openlora_otel import TelemetryConfig
    from openlora_otel.hardware import nvml
    from tests.support.fake_nvml import FakeNvml, h100s
    from tests.support.metrics_paths import MetricsPath

    cards = h100s(1)
    monkeypatch.setattr(nvml, "load_pynvml_backend", lambda: FakeNvml(cards))
    rules_dir = tmp_path / "rules"
    rules_dir.mkdir()
    (rules_dir / "openlora.yml").write_text(RULES.read_text())
    with MetricsPath("pull", 3, tmp_path, rule_files=[str(rules_dir / "openlora.yml")]) as metrics:
        config = TelemetryConfig(prometheus_host="127.0.0.1", prometheus_port=0)
        config = dataclasses.replace(config, gpu_metrics="on", gpu_devices="all")
        _check_every_inference_query(metrics, config, cards[0], through=through)


def _check_every_inference_query(
    metrics: MetricsPath, config: TelemetryConfig, gpu: FakeGpu, through: str | None = None
) -> None:
    from openlora_otel import setup_telemetry

    telemetry = setup_telemetry("openlora-serve", run_id=RUN_ID, run_name="serve", config=config)
    held: list = []
    server = None
    try:
        if through is not None:
            server = {"wsgi": WsgiServer, "grpc": GrpcServer}[through](telemetry)
        inference = telemetry.inference
        inference.set_model("tiny-llama")
        for name in (*SERVED, "idle", "old"):
            with inference.loading_adapter(name, trained_by=ORIGINS.get(name)):
                time.sleep(0.01)
        inference.adapter_unloaded("old")
        with pytest.raises(FileNotFoundError), inference.loading_adapter("broken"):
            raise FileNotFoundError("no adapter_config.json")
        # One request waiting in the queue and one running, held open while Prometheus scrapes.
        held = [inference.request("a1", queued=True), inference.request("a2")]

        if metrics.push:
            target = telemetry.resource.attributes["service.instance.id"]
        else:
            target = telemetry.prometheus_url.removeprefix("http://").removesuffix("/metrics")
        prometheus = metrics.scrape([target])
        with Traffic(inference, gpu, through=server) as traffic:
            assert prometheus.wait_for(
                'sum(gen_ai_server_request_duration_seconds_count{error_type="RuntimeError"}) >= 2',
                timeout=90,
            ), prometheus.query("up")
            time.sleep(4)  # several scrapes with traffic: rates over the panels' 15 s have data
            if metrics.native:  # not vacuous: the requests' histograms are native ones there
                names = set(prometheus.get("/api/v1/label/__name__/values")["data"])
                assert "gen_ai_server_time_to_first_token_seconds" in names, sorted(names)
                assert not {name for name in names if name.endswith("_bucket")}, sorted(names)
            # Bounded wait: the energy records are a chain (GPU power, the server's share, the adapters'
            # shares); on VictoriaMetrics each link comes back through vmalert's remote write, an
            # evaluation or two behind the one before.
            wait_until(
                lambda: prometheus.query("adapter:openlora_inference_energy_per_output_token_joules:2m"),
                timeout=60,
            )
            problems = run_every_query(
                INFERENCE_DASHBOARD, prometheus.query, http_variable_options(prometheus.url), RUN_ID
            )
            assert not problems, "\n".join(problems)

            # Energy: the fake GPU's counter rose by JOULES_PER_OUTPUT_TOKEN per token generated, and this
            # server is the only one on it, so every adapter that generated gets that many joules per
            # output token (the rules' 2-minute rates of the energy counter and of the token counts).
            # Bounded wait until it holds, while the traffic runs: the first evaluations see a few
            # samples of each series, and through a remote-write store (Thanos Receive, Cortex) the
            # energy and each adapter's tokens arrive in separate batches, so their 2-minute rates start
            # from different samples (CI once read a1 1.34, a2 0.83 J at the first evaluation).
            per_token = "adapter:openlora_inference_energy_per_output_token_joules:2m"

            def joules() -> dict[str, float]:
                return {s["metric"]["openlora_adapter_name"]: float(s["value"][1]) for s in prometheus.query(per_token)}

            def settled() -> bool:
                found = joules()
                return set(found) >= set(SERVED) and all(
                    j == pytest.approx(JOULES_PER_OUTPUT_TOKEN, rel=0.25) for j in found.values()
                )

            assert wait_until(settled, timeout=60), joules()

            def first(title: str, index: int = 0, **values: str) -> str:
                (panel,) = [p for p in panels(INFERENCE_DASHBOARD) if p["title"] == title]
                return substitute(panel["targets"][index]["expr"], **values)

            # Every adapter that had requests, the base model, the unserved name, and the loaded
            # adapter without traffic (at 0); not the unloaded-before-use one, nor the broken one.
            by_adapter = {
                s["metric"]["openlora_adapter_name"]: float(s["value"][1])
                for s in prometheus.query(first("Requests/s by adapter"))
            }
            assert set(by_adapter) >= {"a1", "a2", "base", "other", "idle"} and "broken" not in by_adapter, (
                by_adapter
            )
            assert by_adapter["idle"] == 0 and by_adapter["a1"] > 0 and by_adapter["base"] > 0, by_adapter
            options = http_variable_options(prometheus.url)
            (adapter_variable,) = [
                v for v in dashboard(INFERENCE_DASHBOARD)["templating"]["list"] if v["name"] == "adapter"
            ]
            assert {value for _, value in options(adapter_variable, {})} == set(by_adapter)
            # The adapter variable narrows every panel: one adapter selected, only its series.
            only_a2 = prometheus.query(first("Requests/s by adapter", adapter="a2"))
            assert [s["metric"]["openlora_adapter_name"] for s in only_a2] == ["a2"]
            # Output tokens per successful request, exactly: the panel reads the output token type
            # (20 input tokens a request would give 20). One query, so both rates see the same samples.
            per_request = value(
                prometheus.query(
                    f"sum({first('Output tokens/s by adapter')}) / "
                    + substitute(
                        'sum(rate(openlora_inference_token_usage_count{gen_ai_token_type="output"}'
                        "[$__rate_interval]))"
                    )
                )
            )
            assert per_request == pytest.approx(OUTPUT_TOKENS), per_request
            # Each request slept at least this long: the percentiles are at least the lower edge of
            # the bucket that holds it (histogram_quantile interpolates inside a bucket), in seconds.
            p50 = value(prometheus.query(first("Request duration p50 / p95 / p99")))
            assert floor(REQUEST_DURATION_BUCKETS, QUEUE_S + FIRST_TOKEN_S + GENERATE_S) <= p50 < 2, p50
            ttft = value(prometheus.query(first("Time to first token p50 / p95 / p99")))
            assert floor(TTFT_BUCKETS, QUEUE_S + FIRST_TOKEN_S) <= ttft < 2, ttft
            # Errors by type: the exception's class name and the client's unknown_adapter; the
            # server's share as the alert counts it, one request in a cycle.
            by_type = {
                s["metric"]["error_type"] for s in prometheus.query(first("Error ratio by error type"))
            }
            client_error = "unknown_adapter" if server is None else server.client_error
            assert by_type == {"RuntimeError", client_error}, by_type
            # The rule's window holds every request so far: the ratio of what was sent, within
            # the requests of one scrape interval that the rate window has not seen yet.
            # Bounded wait: on VictoriaMetrics both recording rules go through vmalert's evaluation and
            # its remote write, some seconds behind the data (CI once read the ratio before either).
            ratio = "instance:openlora_inference_server_errors:rate5m / instance:openlora_inference_requests:rate5m"
            wait_until(lambda: len(prometheus.query(ratio)) == 1, timeout=30)
            recorded = value(prometheus.query(ratio))
            assert recorded == pytest.approx(1 / len(CYCLE), rel=0.35), (recorded, traffic.sent)
            # Adapters: the three loaded ones counted, the unloaded one not; the failed load shown,
            # and the alert's expression finds it.
            assert value(prometheus.query(first("Adapters loaded"))) == 3
            loaded = prometheus.query(first("Adapters loaded, per server"))
            assert sorted(s["metric"]["openlora_adapter_name"] for s in loaded) == ["a1", "a2", "idle"], (
                loaded
            )
            failed = prometheus.query(first("Failed adapter loads"))
            assert [(s["metric"]["openlora_adapter_name"], s["metric"]["error_type"]) for s in failed] == [
                ("broken", "FileNotFoundError")
            ]
            # Bounded wait: the alert joins a recording rule, which on VictoriaMetrics vmalert writes back
            # a few evaluations after the data arrived.
            load_failed = rule("OpenloraInferenceAdapterLoadFailed")["expr"]
            wait_until(lambda: bool(prometheus.query(load_failed)), timeout=30)
            alert = prometheus.query(load_failed)
            assert [
                (s["metric"]["openlora_adapter_name"], s["metric"]["openlora_run_id"]) for s in alert
            ] == [("broken", RUN_ID)], alert
            # Each loaded adapter's origin, one row each; not the unloaded one's.
            rows = {
                s["metric"]["openlora_adapter_name"]: s["metric"]
                for s in prometheus.query(first("Adapters and their training runs"))
            }
            assert sorted(rows) == ["a1", "a2", "idle"], rows
            assert rows["a1"]["openlora_training_run_id"] == "train-a1"
            assert rows["a1"]["openlora_training_run_name"] == "support-v2"
            assert rows["a1"]["openlora_adapter_base_model"] == "tiny-llama"
            assert rows["a1"]["openlora_adapter_base_fingerprint"] == "0123abcd"
            assert rows["a1"]["openlora_training_final_eval_loss"] == "1.25"
            assert rows["a1"]["openlora_run_id"] == RUN_ID  # the server's own run, from target_info
            assert rows["a2"]["openlora_training_run_id"] == "train-a2"
            assert "openlora_training_run_name" not in rows["a2"] and "openlora_training_run_id" not in rows["idle"]
            load_times = prometheus.query(first("Adapter load time, slowest first"))
            assert {s["metric"]["openlora_adapter_name"] for s in load_times} == {*SERVED, "idle", "old"}, (
                load_times
            )
            assert all(0.01 <= float(s["value"][1]) < 1 for s in load_times), load_times

        # Traffic stopped: only the two held requests are in flight.
        # Bounded wait for the last interval with traffic to pass through (pulled: the next scrape;
        # through the agent and gateway tiers: an export and two batches, some seconds).
        wait_until(
            lambda: value(prometheus.query(first("Waiting requests"))) == 1
            and value(prometheus.query(first("Running requests"))) == 1,
            timeout=30,
        )
        assert value(prometheus.query(first("Waiting requests"))) == 1
        assert value(prometheus.query(first("Running requests"))) == 1
        by_state = {
            (index, s["metric"]["instance"]): float(s["value"][1])
            for index in (0, 1)
            for s in prometheus.query(first("Running and waiting requests", index))
        }
        assert by_state == {(0, target): 1, (1, target): 1}, by_state
    finally:
        for request in held:
            request.end()
        if server is not None:
            server.close()
        telemetry.shutdown()
