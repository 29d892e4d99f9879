"""AIPerf (NVIDIA's LLM benchmark client, from PyPI) against ``openlora-otel serve``, for tests/serving/test_aiperf.py.

AIPerf lives in a virtual environment of its own, ``.venv-aiperf`` (``tools/setup-real-parts.sh``
builds it, and ``.ci/run`` through it: ``pip install aiperf==0.13.0``, no torch), or wherever
``$OPENLORA_AIPERF`` names its ``aiperf`` executable. A test that needs it skips when it is missing,
except under CI (``CI`` set), where a missing AIPerf is a failure, as for the servers in
tests/support/built.py.

Nothing is downloaded at run time: AIPerf's tokenizer is a local directory made here with that
environment's ``tokenizers`` and ``transformers`` (one token per character of the demo's alphabet, as
the served model's tokenizer), and every AIPerf run gets an HTTP(S) proxy that refuses, loopback
excepted, so a download would fail the run instead of reaching the network. ``HF_HUB_OFFLINE`` is not
set: AIPerf 0.13 then resolves even a local path through ``snapshot_download``, and fails.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import signal
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

from tests.support.processes import child_env, free_port
from tests.support.real_parts import missing

ROOT = Path(__file__).resolve().parent.parent.parent
VERSION = "0.13.0"  # the version .ci/run installs; checked against what the run reports

# Read once, when the tests are loaded: each test runs without any OPENLORA_* variable
# (tests/conftest.py's clean_env, which imports this module first).
_AIPERF = os.environ.get("OPENLORA_AIPERF")

# The demo model's tokenizer as a Hugging Face fast tokenizer: one token per character of ALPHABET,
# anything else lowered or turned into a space first (AIPerf's prompts come from Shakespeare's text,
# with capitals and digits the model does not know; the server refuses such a character with 400).
_TOKENIZER_SCRIPT = r"""
import sys
from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers
from transformers import PreTrainedTokenizerFast

directory, alphabet = sys.argv[1], sys.argv[2]
vocab = {"<unk>": 0, **{c: i + 1 for i, c in enumerate(alphabet)}}
tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
outside = "[^" + "".join("\\n" if c == "\n" else "\\" + c if c in "\\]^-[" else c for c in alphabet) + "]"
tokenizer.normalizer = normalizers.Sequence([normalizers.Lowercase(), normalizers.Replace(Regex(outside), " ")])
tokenizer.pre_tokenizer = pre_tokenizers.Split(pattern="", behavior="isolated")
tokenizer.decoder = decoders.Fuse()
PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="<unk>").save_pretrained(directory)
check = PreTrainedTokenizerFast.from_pretrained(directory)
text = "Hello, World 42!"
assert check.decode(check.encode(text)) == "hello, world   !", check.decode(check.encode(text))
"""


def aiperf_binary() -> Path:
    """The ``aiperf`` executable; skips (fails under CI) when it is not installed."""
    path = Path(_AIPERF) if _AIPERF else ROOT / ".venv-aiperf" / "bin" / "aiperf"
    if path.is_file() and os.access(path, os.X_OK):
        return path
    missing(
        ".venv-aiperf",
        f"{path} is not installed: python3 -m venv .venv-aiperf && .venv-aiperf/bin/pip install "
        f"aiperf=={VERSION} (or set OPENLORA_AIPERF to an aiperf executable)",
    )


def make_tokenizer(aiperf: Path, directory: Path, alphabet: str, timeout: float = 120) -> Path:
    """Write the character tokenizer for ``alphabet`` into ``directory`` with AIPerf's own Python (the
    interpreter its script names, which pip writes as an absolute path)."""
    first = aiperf.read_bytes().split(b"\n", 1)[0].decode()
    python = first[2:].strip() if first.startswith("#!/") else str(aiperf.parent / "python")
    done = subprocess.run(
        [python, "-c", _TOKENIZER_SCRIPT, str(directory), alphabet],
        env=_environment(directory.parent),
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return directory


def _environment(workdir: Path, tmpdir: Path | None = None) -> dict[str, str]:
    """AIPerf's environment: its Hugging Face cache under ``workdir``, its temporary files (memory-mapped
    dataset, ZMQ IPC sockets) in ``tmpdir``, and a proxy that refuses any download."""
    refused = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    return child_env(
        HF_HOME=str(workdir / "hf-home"),
        HF_HUB_DISABLE_TELEMETRY="1",
        HTTP_PROXY=refused,
        HTTPS_PROXY=refused,
        http_proxy=refused,
        https_proxy=refused,
        NO_PROXY="127.0.0.1,localhost",
        no_proxy="127.0.0.1,localhost",
        **({"TMPDIR": str(tmpdir)} if tmpdir is not None else {}),
    )


@dataclass
class Record:
    """One request of ``profile_export.jsonl`` (AIPerf reports milliseconds; these are seconds)."""

    ok: bool
    ttft_s: float | None  # time_to_first_token: the request's start to its first content response
    latency_s: float | None  # request_latency: the request's start to its last response
    prompt_tokens: int | None  # usage_prompt_tokens: the server's usage
    completion_tokens: int | None  # usage_completion_tokens: the server's usage
    output_tokens: int | None  # output_sequence_length: AIPerf's tokenizer on the text it received
    connection_reused: bool | None  # http_req_connection_reused


@dataclass
class Profile:
    """One ``aiperf profile`` run: its per-request records and its summary (``profile_export_aiperf.json``)."""

    argv: list[str]
    records: list[Record]
    summary: dict

    @property
    def ok(self) -> list[Record]:
        return [record for record in self.records if record.ok]

    def summary_quantile_s(self, metric: str, q: float) -> float:
        """AIPerf's own p50 / p95 of ``metric`` (``time_to_first_token``, ``request_latency``), in s: the
        linear interpolation between the two values around rank (n - 1) q + 1."""
        entry = self.summary[metric]
        assert entry["unit"] == "ms", entry
        return entry[f"p{round(q * 100)}"] / 1000

    def quantile_s(self, attribute: str, q: float) -> float:
        """The successful requests' ``attribute`` (``ttft_s``, ``latency_s``) of rank ceil(q n), the rank
        ``histogram_quantile`` takes: the p50 / p95 to set against the server's. AIPerf's own (its
        summary's) interpolates between two requests' values, which can lie far apart: the time to first
        token is about 0 for a request that finds the server's slot free and about one generation for one
        that waits, so an interpolated median can fall between the two, where no request is."""
        values = sorted(getattr(record, attribute) for record in self.ok)
        return values[max(1, math.ceil(q * len(values))) - 1]


def _value(metrics: dict, name: str, scale: float = 1.0) -> float | None:
    entry = metrics.get(name)
    if entry is None:
        return None
    assert entry["unit"] in ("ms", "tokens", "ratio"), (name, entry)
    return entry["value"] * (0.001 if entry["unit"] == "ms" else scale)


def read_records(path: Path) -> list[Record]:
    records = []
    for line in path.read_text().splitlines():
        record = json.loads(line)
        assert record["metadata"]["benchmark_phase"] == "profiling", record["metadata"]
        metrics = record["metrics"]
        reused = _value(metrics, "http_req_connection_reused")
        tokens = {
            name: None if (value := _value(metrics, name)) is None else int(value)
            for name in ("usage_prompt_tokens", "usage_completion_tokens", "output_sequence_length")
        }
        records.append(
            Record(
                ok=record.get("error") is None,
                ttft_s=_value(metrics, "time_to_first_token"),
                latency_s=_value(metrics, "request_latency"),
                prompt_tokens=tokens["usage_prompt_tokens"],
                completion_tokens=tokens["usage_completion_tokens"],
                output_tokens=tokens["output_sequence_length"],
                connection_reused=None if reused is None else bool(reused),
            )
        )
    return records


def profile(
    aiperf: Path,
    url: str,
    model: str,
    endpoint_type: str,
    tokenizer: Path,
    artifacts: Path,
    *,
    requests: int,
    concurrency: int,
    input_tokens: int,
    output_tokens: int,
    seed: int = 7,
    timeout: float = 240,
) -> Profile:
    """``aiperf profile`` streaming ``requests`` synthetic requests (``endpoint_type`` chat or completions)
    to ``model`` at ``url``, ``concurrency`` at a time; bounded by ``timeout`` (its process group killed
    past it)."""
    argv = [
        str(aiperf), "profile",
        "--model", model, "--url", url, "--endpoint-type", endpoint_type, "--streaming",
        "--tokenizer", str(tokenizer),
        "--request-count", str(requests), "--concurrency", str(concurrency),
        "--synthetic-input-tokens-mean", str(input_tokens), "--synthetic-input-tokens-stddev", "0",
        "--output-tokens-mean", str(output_tokens), "--output-tokens-stddev", "0",
        "--random-seed", str(seed),
        "--request-timeout-seconds", "60",
        "--artifact-dir", str(artifacts),
        "--ui-type", "none",
        # Nothing else to reach: no DCGM exporter, and serve's metrics are on their own port (Prometheus's).
        "--no-gpu-telemetry", "--no-server-metrics",
    ]  # fmt: skip
    artifacts.mkdir(parents=True, exist_ok=True)
    log = artifacts / "aiperf-output.log"
    # A short directory of its own: a ZMQ IPC socket's path must fit in 107 characters, and AIPerf leaves
    # an aiperf_mmap_* directory behind in it.
    tmpdir = Path(tempfile.mkdtemp(prefix="aiperf-"))
    with log.open("w") as output:
        process = subprocess.Popen(
            argv,
            env=_environment(artifacts, tmpdir),
            cwd=artifacts,
            stdout=output,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # its services are child processes: one group to kill
        )
        try:
            code = process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            code = None
        finally:
            if process.poll() is None:  # past the timeout, or the test interrupted
                os.killpg(process.pid, signal.SIGKILL)
                process.wait(timeout=10)
            shutil.rmtree(tmpdir, ignore_errors=True)
    assert code is not None, f"aiperf ran past {timeout} s:\n{log.read_text()[-3000:]}"
    # AIPerf 0.13 exits 0 even when its services fail to start: the summary is the proof of a run.
    summary_path = artifacts / "profile_export_aiperf.json"
    assert code == 0 and summary_path.is_file(), f"aiperf exited with {code}:\n{log.read_text()[-3000:]}"
    summary = json.loads(summary_path.read_text())
    assert summary["aiperf_version"] == VERSION, summary["aiperf_version"]
    return Profile(argv, read_records(artifacts / "profile_export.jsonl"), summary)
