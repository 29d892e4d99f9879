// Command blockgen writes Prometheus TSDB blocks of synthetic series, for benchmarks/bench_long_term.py.
//
// It reads one JSON object a line from -spec: {"labels": {"__name__": ..., ...}, "model": M, "p": [...]},
// and writes a sample every -interval seconds from -start to -end (Unix seconds) for every series, in
// blocks of -block seconds, into -out: the layout Prometheus and a Thanos bucket read. The models are
// functions of the sample time t (seconds) and the start t0:
//
//	const   p0
//	linear  p0 + p1*(t-t0)                                   counters that grow at a steady rate
//	sine    p0*(1 + p1*sin(t/p2 + p3))                       gauges that vary
//	decay   p0 + p1/sqrt(1 + p2*(t-t0)) + p3*sin(t/60 + p4)   a training loss
//	now     t - p0                                           a timestamp gauge
//
// Python writing OpenMetrics for promtool would take hours for the billion samples of a month of a
// 64-rank run; Prometheus's own block writer (tsdb.BlockWriter) takes minutes.
package main

import (
	"bufio"
	"context"
	"encoding/json"
	"flag"
	"fmt"
	"log/slog"
	"math"
	"os"
	"time"

	"github.com/prometheus/prometheus/model/labels"
	"github.com/prometheus/prometheus/storage"
	"github.com/prometheus/prometheus/tsdb"
)

type series struct {
	labels labels.Labels
	model  string
	p      []float64
}

type line struct {
	Labels map[string]string `json:"labels"`
	Model  string            `json:"model"`
	P      []float64         `json:"p"`
}

var arity = map[string]int{"const": 1, "linear": 2, "sine": 4, "decay": 5, "now": 1}

func (s *series) value(t, t0 float64) float64 {
	p := s.p
	switch s.model {
	case "const":
		return p[0]
	case "linear":
		return p[0] + p[1]*(t-t0)
	case "sine":
		return p[0] * (1 + p[1]*math.Sin(t/p[2]+p[3]))
	case "decay":
		return p[0] + p[1]/math.Sqrt(1+p[2]*(t-t0)) + p[3]*math.Sin(t/60+p[4])
	default: // now
		return t - p[0]
	}
}

func readSpec(path string) ([]series, error) {
	file, err := os.Open(path)
	if err != nil {
		return nil, err
	}
	defer file.Close()
	var all []series
	scanner := bufio.NewScanner(file)
	scanner.Buffer(make([]byte, 1<<20), 1<<20)
	for n := 1; scanner.Scan(); n++ {
		var l line
		if err := json.Unmarshal(scanner.Bytes(), &l); err != nil {
			return nil, fmt.Errorf("%s:%d: %w", path, n, err)
		}
		if want, ok := arity[l.Model]; !ok || len(l.P) != want {
			return nil, fmt.Errorf("%s:%d: model %q with %d parameters (accepted: const 1, linear 2, sine 4, decay 5, now 1)", path, n, l.Model, len(l.P))
		}
		if l.Labels["__name__"] == "" {
			return nil, fmt.Errorf("%s:%d: no __name__ label", path, n)
		}
		all = append(all, series{labels.FromMap(l.Labels), l.Model, l.P})
	}
	return all, scanner.Err()
}

func fail(err error) {
	fmt.Fprintln(os.Stderr, "blockgen:", err)
	os.Exit(1)
}

func main() {
	spec := flag.String("spec", "", "the series, one JSON object a line")
	out := flag.String("out", "", "the directory the blocks go into")
	start := flag.Int64("start", 0, "the first sample's time, Unix seconds")
	end := flag.Int64("end", 0, "no sample at or after this time, Unix seconds")
	interval := flag.Int64("interval", 15, "seconds between samples")
	block := flag.Int64("block", 7200, "seconds of each block (aligned to multiples of it, as Prometheus's)")
	flag.Parse()
	if *spec == "" || *out == "" || *end <= *start || *interval <= 0 || *block <= 0 {
		fmt.Fprintln(os.Stderr, "blockgen: -spec, -out, -start < -end, -interval > 0 and -block > 0 are needed")
		os.Exit(2)
	}
	all, err := readSpec(*spec)
	if err != nil {
		fail(err)
	}
	logger := slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelWarn}))
	ctx := context.Background()
	t0 := float64(*start)
	began := time.Now()
	samples := 0
	for blockStart := *start - *start%*block; blockStart < *end; blockStart += *block {
		writer, err := tsdb.NewBlockWriter(logger, *out, *block*1000)
		if err != nil {
			fail(err)
		}
		first := max(blockStart, *start)
		first += (*interval - (first-*start)%*interval) % *interval // on the grid from -start
		last := min(blockStart+*block, *end)
		// Time-major, as Prometheus appends: its head refuses a sample older than half a block
		// behind the newest it holds.
		refs := make([]storage.SeriesRef, len(all))
		for t := first; t < last; t += *interval {
			app := writer.Appender(ctx)
			for i := range all {
				s := &all[i]
				refs[i], err = app.Append(refs[i], s.labels, t*1000, s.value(float64(t), t0))
				if err != nil {
					fail(err)
				}
			}
			samples += len(all)
			if err := app.Commit(); err != nil {
				fail(err)
			}
		}
		if _, err := writer.Flush(ctx); err != nil {
			fail(err)
		}
		if err := writer.Close(); err != nil {
			fail(err)
		}
	}
	fmt.Printf("%d series, %d samples in %.1f s\n", len(all), samples, time.Since(began).Seconds())
}
