"""Bounds between a client's per-request times and a server's histograms of the same requests.

Each request's client time is its server time plus an overhead o >= 0 (connect, parsing, the event loop
handing the first token to the socket; the server's duration ends after its last send, so o may be a
hair below 0: ``SLACK_S`` is allowed). :func:`assert_histogram_holds_client_values` and
:func:`assert_quantile_not_above_client` hold for every run whatever the load (see
tests/serving/test_serving_e2e.py's docstring for why); :func:`assert_same_or_neighbouring_bucket` is the
comparison of a client's reported quantile with the server's ``histogram_quantile``, which needs the
overheads to be small next to the buckets' widths.

Shared by tests/serving/test_serving_e2e.py (``openlora-otel load``) and tests/serving/test_aiperf.py (AIPerf).
"""

from __future__ import annotations

import bisect
import math


def bucket_index(value: float, bounds: tuple[float, ...] | list[float]) -> int:
    """The bucket holding ``value``: i for bounds[i-1] < value <= bounds[i] (``le``), len(bounds) for +Inf."""
    return bisect.bisect_left(list(bounds), value)


SLACK_S = 0.001  # how far a server time may exceed its client time (the end after the last send)


def assert_histogram_holds_client_values(
    what: str, cumulative: dict[float, int], client: list[float], server_sum: float, bounds: tuple[float, ...]
) -> None:
    """``cumulative`` (bucket bound -> server values <= it, from the ``_bucket`` series) against the
    clients' values of the same requests, each its server value plus an overhead >= -SLACK_S."""
    n = len(client)
    assert cumulative[float("inf")] == n, (what, cumulative, n)
    assert sorted(cumulative) == [*bounds, float("inf")], (what, sorted(cumulative))
    # The sums are exact: the server's mean is the client's less the HTTP around each request.
    server_mean, client_mean = server_sum / n, sum(client) / n
    assert server_mean <= client_mean + SLACK_S, (
        f"{what}: the server's mean {server_mean:.4f} s is above the clients' {client_mean:.4f} s"
    )
    assert client_mean - server_mean < 0.1, (
        f"{what}: the server's mean {server_mean:.4f} s is more than 100 ms below the clients' {client_mean:.4f} s"
    )
    # Overheads shifted to be >= 0: their sum is exact, so few of them can be large (Markov).
    shifted_sum = sum(client) - server_sum + n * SLACK_S
    for bound in bounds:
        at_least = sum(value <= bound - SLACK_S for value in client)
        large = math.floor(shifted_sum / (bound + SLACK_S))
        at_most = sum(value <= 2 * bound for value in client) + large
        assert at_least <= cumulative[bound] <= at_most, (
            f"{what}: {cumulative[bound]} of {n} server values <= {bound} s; the clients' values allow "
            f"{at_least} to {at_most} (client values: {sorted(client)})"
        )


def assert_quantile_not_above_client(
    what: str, q: float, server_quantile: float, client: list[float], bounds: tuple[float, ...]
) -> None:
    """``histogram_quantile(q)`` lies in the bucket of the server's order statistic of rank ceil(q n), which is
    at most the client's of that rank (+ SLACK_S): so at most that bucket's upper edge."""
    ordered = sorted(client)
    rank = max(1, math.ceil(q * len(ordered)))
    edges = [*bounds, float("inf")]
    ceiling = edges[bucket_index(ordered[rank - 1] + SLACK_S, bounds)]
    assert server_quantile <= ceiling, (
        f"{what}: server {server_quantile:.4f} s, above the bucket ending at {ceiling} s that holds the "
        f"client's value of rank {rank} of {len(ordered)} ({ordered[rank - 1]:.4f} s)"
    )


def bucket_edges(index: int, bounds: tuple[float, ...] | list[float]) -> tuple[float, float]:
    """The (lower, upper] edges of bucket ``index`` (:func:`bucket_index`'s numbering)."""
    edges = [0.0, *bounds, float("inf")]
    return edges[index], edges[index + 1]


def assert_same_or_neighbouring_bucket(
    what: str, client_quantile: float, server_quantile: float, bounds: tuple[float, ...]
) -> None:
    """A client's quantile and the server's ``histogram_quantile`` of the same requests lie in the same
    bucket of the server's histogram or in neighbouring ones."""
    client_bucket, server_bucket = (
        bucket_index(client_quantile, bounds),
        bucket_index(server_quantile, bounds),
    )
    assert abs(client_bucket - server_bucket) <= 1, (
        f"{what}: client {client_quantile:.4f} s in bucket {bucket_edges(client_bucket, bounds)}, server "
        f"{server_quantile:.4f} s in bucket {bucket_edges(server_bucket, bounds)}: more than one bucket apart"
    )
