"""GPU depth without a GPU: batched field values and their fallbacks, XID events, remapped rows, PCIe
link state, hw.status and GPM activity, each present where the fake GPU has it and absent where not."""

from __future__ import annotations

import ctypes
import re
import threading
from pathlib import Path

import pytest

from openlora_otel.hardware import gpu_reads, gpu_snapshot, gpu_thread, nvml
from openlora_otel.hardware.gpu import FIELDS
from openlora_otel.hardware.nvml import (
    FI,
    GPM,
    PERF_POLICY,
    RECOVERY,
    SCOPE_ALL_LINKS,
    GpuError,
    PynvmlBackend,
)
from openlora_otel.names import XID_CODES
from tests.support import fake_nvml
from tests.support.fake_nvml import FakeGpu, FakeNvml, fake_pynvml_module, h100s, older_gpu
from tests.support.gpu import SteppedTime, build, series

# gpu.py's clock is stepped in every test here (tests/conftest.py's stepped_time).
pytestmark = pytest.mark.usefixtures("stepped_time")

OLD_CALLS_PER_GPU = 12  # before batching: one NVML call per value (see git history of openlora_otel/hardware/gpu.py)


def by(data, name: str, key: str) -> dict:
    return {attrs[key]: value for attrs, value in series(data, name)}


def status(data) -> dict[str, str]:
    """hw.id -> the hw.state whose series is 1."""
    states: dict[str, str] = {}
    for attrs, value in series(data, "hw.status"):
        if value == 1:
            assert attrs["hw.id"] not in states, "two states at 1 for one GPU"
            states[attrs["hw.id"]] = attrs["hw.state"]
    return states


# -- calls per snapshot ------------------------------------------------------------------------


def test_fewer_nvml_calls_per_gpu_than_one_per_value(collect) -> None:
    fake = FakeNvml(h100s(8), driver="580.82.07")
    reader, _ = build(fake)
    collect(reader)  # discovery, link maximum, GPM sample allocation, event registration
    fake.calls.clear()
    collect(reader)
    per_gpu = {name: count / 8 for name, count in fake.calls.items() if name != "wait_xid"}
    assert fake.calls["wait_xid"] == 1  # one drain of the one event set, not one per GPU
    assert sum(per_gpu.values()) == 10 < OLD_CALLS_PER_GPU  # 8 + 2 GPM calls on Hopper
    assert fake.calls["field_values"] == 8
    # ... for far more values than the 12 it used to read.
    asked = len(fake.fields_asked[-1])
    # The two hw_* throttle times at one numbering: R580's ids, not the ones replacing them nor later drivers'.
    assert asked == len(FIELDS) - 4
    assert asked + len(gpu_reads.QUERIES) + 4 > 2.5 * OLD_CALLS_PER_GPU

    # A pre-Hopper board on a driver that answers the throttle and power fields: 8.
    older = FakeNvml([older_gpu(unsupported_fields=set())], driver="535.104.05")
    reader, _ = build(older)
    collect(reader)
    older.calls.clear()
    collect(reader)
    assert older.total_calls - older.calls["wait_xid"] == 8
    # The worst case, every fallback taken (no average-power or throttle fields): as many calls as
    # before, for three throttle durations and the replay counter the old snapshot did not have.
    oldest = FakeNvml([older_gpu()], driver="535.104.05")
    reader, _ = build(oldest)
    collect(reader)
    oldest.calls.clear()
    collect(reader)
    assert oldest.total_calls - oldest.calls["wait_xid"] == OLD_CALLS_PER_GPU


def test_an_unsupported_field_falls_back_to_its_own_call_and_is_not_asked_again(collect) -> None:
    card = older_gpu()
    fake = FakeNvml([card], driver="535.104.05")
    reader, _ = build(fake)
    data = collect(reader)
    attrs = lambda name: [a for a, _ in series(data, name)]  # noqa: E731
    assert (
        series(data, "hw.power")[0][1] == card.power_w
    )  # POWER_AVERAGE unsupported: nvmlDeviceGetPowerUsage
    assert by(data, "openlora.gpu.throttle.time", "openlora.gpu.throttle.reason") == {
        "sw_power_cap": 1.5,  # nvmlDeviceGetViolationStatus
        "thermal": 0.25,
        "sync_boost": 0.0,
    }
    assert attrs("hw.gpu.io") == [] and attrs("openlora.gpu.nvlink.io") == []  # no field, no fallback
    assert attrs("openlora.gpu.remap.rows") == [] and attrs("openlora.gpu.remap.pending") == []
    assert by(data, "hw.errors", "error.type") == {"corrected": 3, "uncorrected": 0}
    assert by(data, "openlora.gpu.pcie.errors", "error.type") == {"replay": 2}
    assert fake.calls["remapped_rows"] == 1 and fake.calls["violation_s"] == 3
    fake.calls.clear()
    asked_before = set(fake.fields_asked[-1])
    collect(reader)
    asked_now = set(fake.fields_asked[-1])
    assert asked_now < asked_before
    assert not {fid for fid, _ in asked_now} & card.unsupported_fields
    assert fake.calls["remapped_rows"] == 0  # NotSupported remembered
    assert fake.calls["violation_s"] == 3 and fake.calls["power_w"] == 1  # the fallbacks that answer


def test_field_values_call_itself_unsupported_reads_each_value_alone(collect) -> None:
    [card] = h100s(1, unsupported={"field_values"})
    fake = FakeNvml([card])
    reader, _ = build(fake)
    data = collect(reader)
    assert series(data, "hw.power")[0][1] == 312.5
    assert series(data, "hw.energy")[0][1] == 123456.789
    assert by(data, "hw.errors", "error.type") == {"corrected": 3, "uncorrected": 0}
    assert by(data, "openlora.gpu.pcie.errors", "error.type") == {"replay": 2}
    assert set(by(data, "openlora.gpu.remap.rows", "openlora.gpu.remap.cause")) == {
        "correctable",
        "uncorrectable",
    }
    assert fake.calls["remapped_rows"] == 1  # one call answers all four remap values
    collect(reader)
    assert fake.calls["field_values"] == 1  # asked once, remembered


def test_renumbered_throttle_fields_are_asked_only_of_drivers_that_number_them_so(collect) -> None:
    fake = FakeNvml(h100s(1), driver="550.54.15")
    reader, _ = build(fake)
    data = collect(reader)
    asked = {fid for fid, _ in fake.fields_asked[-1]}
    assert not asked & {
        FI.CLOCKS_EVENT_REASON_HW_THERM_SLOWDOWN,
        FI.CLOCKS_EVENT_REASON_HW_POWER_BRAKE_SLOWDOWN,
    }
    assert set(by(data, "openlora.gpu.throttle.time", "openlora.gpu.throttle.reason")) == {
        "sw_power_cap",
        "thermal",
        "sync_boost",
    }


@pytest.mark.parametrize(
    ("driver", "ids"),
    [
        ("580.65.06", {252, 253}),  # R580 numbers them as nvidia-smi 580.65.06 asks (270/271: power smoothing)
        ("590.44.01", {FI.CLOCKS_EVENT_REASON_HW_THERM_SLOWDOWN, FI.CLOCKS_EVENT_REASON_HW_POWER_BRAKE_SLOWDOWN}),
    ],
)
def test_hw_throttle_times_are_read_at_the_ids_the_driver_numbers_them(collect, driver, ids) -> None:
    [card] = h100s(1)
    card.throttle_ns.update(hw_thermal=7_000_000_000, hw_power_brake=3_000)
    fake = FakeNvml([card], driver=driver)
    reader, _ = build(fake)
    data = collect(reader)
    asked = {fid for fid, _ in fake.fields_asked[-1]}
    assert asked & {252, 253, 270, 271} == ids
    times = by(data, "openlora.gpu.throttle.time", "openlora.gpu.throttle.reason")
    assert times["hw_thermal_slowdown"] == 7.0
    assert times["hw_power_brake_slowdown"] == 3e-6


def test_an_r580_driver_that_refuses_252_253_is_read_at_270_271_from_the_first_snapshot(collect, monkeypatch) -> None:
    """580.159.04 on an H200: 252/253 NotSupported, the hw_* throttle times at 270/271 (nvidia-smi
    showed the same 0 us as those fields). Early R580 drivers keep 252/253 and are never asked 270/271,
    which hold power-smoothing settings there."""
    [card] = h100s(1)
    card.throttle_ns.update(hw_thermal=7_000_000_000, hw_power_brake=3_000)
    fake = FakeNvml([card], driver="580.159.04")
    reader, _ = build(fake)
    data = collect(reader)
    first, second = ({fid for fid, _ in call} & {252, 253, 270, 271} for call in fake.fields_asked[-2:])
    assert (first, second) == ({252, 253}, {270, 271})
    times = by(data, "openlora.gpu.throttle.time", "openlora.gpu.throttle.reason")
    assert times["hw_thermal_slowdown"] == 7.0 and times["hw_power_brake_slowdown"] == 3e-6
    fake.fields_asked.clear()
    monkeypatch.setattr(gpu_thread, "FRESH_FOR_S", 0.0)  # the next collection takes a new snapshot
    collect(reader)
    later = [{fid for fid, _ in call} & {252, 253, 270, 271} for call in fake.fields_asked]
    assert later and all(ids == {270, 271} for ids in later)  # one call a snapshot, 252/253 not asked again

    early = FakeNvml(h100s(1), driver="580.82.07")
    reader, _ = build(early)
    collect(reader)
    assert all(not {fid for fid, _ in call} & {270, 271} for call in early.fields_asked)


def test_nvlink_bytes_are_asked_for_all_links_and_absent_without_nvlink(collect) -> None:
    cards = h100s(2)
    cards[1].nvlink_links = 0
    fake = FakeNvml(cards)
    reader, _ = build(fake)
    data = collect(reader)
    assert (FI.NVLINK_THROUGHPUT_DATA_TX, SCOPE_ALL_LINKS) in fake.fields_asked[-1]
    ids = {a["hw.id"] for a, _ in series(data, "openlora.gpu.nvlink.io")}
    assert ids == {cards[0].uuid}
    assert by(data, "openlora.gpu.nvlink.io", "network.io.direction") == {
        "transmit": 18_000_000 * 1024,  # all 18 links, not link 0's share
        "receive": 36_000_000 * 1024,
    }


def test_a_field_failing_in_passing_is_skipped_this_time_only(collect, monkeypatch) -> None:
    [card] = h100s(1)
    fake = FakeNvml([card])
    reader, _ = build(fake)
    collect(reader)  # a GPU with GPM settles where its PCIe bytes come from at its second snapshot
    original = card.field_value
    monkeypatch.setattr(
        card,
        "field_value",
        lambda fid, scope: (27, None) if fid == FI.PCIE_COUNT_TX_BYTES else original(fid, scope),
    )  # NVML_ERROR_NOT_READY
    data = collect(reader)
    assert by(data, "hw.gpu.io", "network.io.direction") == {"receive": 9_000_000_000}
    assert series(data, "hw.gpu.memory.usage")  # the device is fine
    monkeypatch.setattr(card, "field_value", original)
    data = collect(reader)
    assert by(data, "hw.gpu.io", "network.io.direction") == {
        "transmit": 7_000_000_000,
        "receive": 9_000_000_000,
    }


# -- XID events ------------------------------------------------------------------------------


def test_xid_codes_are_counted_per_gpu_with_a_bounded_set_of_values(collect) -> None:
    cards = h100s(2)
    fake = FakeNvml(cards)
    reader, _ = build(fake)
    data = collect(reader)
    assert series(data, "openlora.gpu.xid.errors") == []  # none yet: no series
    assert fake.registered == {c.uuid for c in cards}
    for code in (79, 48, 48, 31, 999, 12345):
        fake.inject_xid(cards[1], code)
    fake.inject_xid(cards[0], 13)
    data = collect(reader)
    counts = {(a["hw.id"], a["openlora.gpu.xid.code"]): v for a, v in series(data, "openlora.gpu.xid.errors")}
    assert counts == {
        (cards[1].uuid, "79"): 1,
        (cards[1].uuid, "48"): 2,
        (cards[1].uuid, "31"): 1,
        (cards[1].uuid, "other"): 2,
        (cards[0].uuid, "13"): 1,
    }
    data = collect(reader)  # cumulative: nothing new, same counts
    assert len(series(data, "openlora.gpu.xid.errors")) == 5
    assert len(XID_CODES) + 1 <= 25  # the attribute's values are bounded


def test_xid_drain_is_bounded_per_snapshot_and_never_blocks(collect) -> None:
    [card] = h100s(1)
    fake = FakeNvml([card])
    reader, _ = build(fake)
    collect(reader)
    for _ in range(300):
        fake.inject_xid(card, 94)
    first = by(collect(reader), "openlora.gpu.xid.errors", "openlora.gpu.xid.code")
    assert first == {"94": gpu_snapshot.XID_PER_SNAPSHOT}
    assert by(collect(reader), "openlora.gpu.xid.errors", "openlora.gpu.xid.code") == {"94": 300}


def test_xid_events_unsupported_means_no_series_and_no_retries(collect) -> None:
    fake = FakeNvml(h100s(2))
    fake.events_supported = False
    reader, _ = build(fake)
    collect(reader)
    data = collect(reader)
    assert series(data, "openlora.gpu.xid.errors") == []
    assert fake.calls["event_set_create"] == 1 and fake.calls["wait_xid"] == 0
    assert set(status(data).values()) == {"ok"}


def test_xid_on_a_mig_gpu_is_counted_once_on_the_parent(collect) -> None:
    parent = FakeGpu(uuid="GPU-aaaa", name="NVIDIA H100 80GB HBM3")
    parent.mig = [
        FakeGpu(uuid="MIG-1111", unsupported={"utilization"}, gpm=None),
        FakeGpu(uuid="MIG-2222", unsupported={"utilization"}, gpm=None),
    ]
    fake = FakeNvml([parent])
    reader, _ = build(fake, devices="process")
    collect(reader)
    assert fake.registered == {"GPU-aaaa"}  # registered on the whole GPU, not the instances
    fake.inject_xid(parent, 48)
    data = collect(reader)
    assert [
        (a["hw.id"], a["openlora.gpu.xid.code"], v) for a, v in series(data, "openlora.gpu.xid.errors")
    ] == [("GPU-aaaa", "48", 1)]
    assert status(data) == {"MIG-1111": "degraded", "MIG-2222": "degraded"}
    # No GPM, link or field calls for instances: those are whole-GPU values.
    assert (
        fake.calls["gpm_sample_get"] == 0 and fake.calls["pcie_link"] == 0 and fake.calls["field_values"] == 0
    )


# -- hw.status ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("change", "expected"),
    [
        ({}, "ok"),
        ({"remap": (1, 0, 1, 0)}, "degraded"),  # a remap waits for a reset
        ({"remap": (1, 4, 0, 1)}, "failed"),  # no spare rows left
        ({"recovery_action": RECOVERY.GPU_RESET}, "degraded"),
        ({"recovery_action": RECOVERY.DRAIN_AND_RESET}, "degraded"),
        ({"recovery_action": RECOVERY.NODE_REBOOT}, "failed"),
        # Newer drivers' actions (nvidia-ml-py 13.615): still "do something", never ok.
        ({"recovery_action": 5}, "degraded"),  # RECOVER_IMEX_DOMAIN (GPU_RESET_BUS in R57x headers)
        ({"recovery_action": 6}, "degraded"),  # BUS_RESET
        ({"recovery_action": 7}, "failed"),  # SYSTEM_REBOOT
        ({"recovery_action": 42}, "degraded"),  # an action this code does not know yet
        ({"xid": 31}, "ok"),  # a program's illegal address: not the GPU's fault
        ({"xid": 63}, "ok"),  # a remap was recorded: the pending flag says what to do
        ({"xid": 48}, "degraded"),
        ({"xid": 95}, "degraded"),
        ({"xid": 79}, "failed"),
    ],
)
def test_hw_status_from_remaps_recovery_action_and_xids(collect, change, expected) -> None:
    cards = h100s(2)
    fake = FakeNvml(cards)
    xid = change.pop("xid", None)
    for key, value in change.items():
        setattr(cards[1], key, value)
    reader, _ = build(fake)
    collect(reader)
    if xid is not None:
        fake.inject_xid(cards[1], xid)
    assert status(collect(reader)) == {cards[0].uuid: "ok", cards[1].uuid: expected}


def test_a_lost_gpu_is_failed_and_the_others_keep_reporting(collect) -> None:
    cards = h100s(3)
    fake = FakeNvml(cards)
    reader, _ = build(fake)
    collect(reader)
    cards[1].failing = True  # answers nothing, not even its handle on re-enumeration
    original_handle = fake.handle

    def handle(index: int):
        if cards[index].failing:
            raise GpuError("GPU is lost")
        return original_handle(index)

    fake.handle = handle
    for _ in range(3):
        data = collect(reader)
        assert status(data) == {cards[0].uuid: "ok", cards[1].uuid: "failed", cards[2].uuid: "ok"}
        assert {a["hw.id"] for a, _ in series(data, "hw.gpu.memory.usage")} == {cards[0].uuid, cards[2].uuid}
    cards[1].failing = False
    data = collect(reader)
    assert status(data) == {c.uuid: "ok" for c in cards}
    assert len(series(data, "hw.gpu.memory.usage")) == 3


# -- PCIe link ---------------------------------------------------------------------------------


def test_pcie_link_maximum_read_once_current_state_at_most_once_a_minute(
    collect,
    stepped_time: SteppedTime,
) -> None:
    [card] = h100s(1, link=(16, 5), link_max=(16, 5))
    fake = FakeNvml([card])
    reader, _ = build(fake)
    collect(reader)
    card.link = (8, 4)  # the link retrains narrower and slower
    data = collect(reader)
    assert series(data, "openlora.gpu.pcie.link.width")[0][1] == 16  # not re-read yet
    stepped_time.offset += gpu_reads.LINK_EVERY_S
    data = collect(reader)
    assert series(data, "openlora.gpu.pcie.link.width")[0][1] == 8
    assert series(data, "openlora.gpu.pcie.link.generation")[0][1] == 4
    assert series(data, "openlora.gpu.pcie.link.width.max")[0][1] == 16
    assert series(data, "openlora.gpu.pcie.link.generation.max")[0][1] == 5
    assert fake.calls["pcie_link_max"] == 1 and fake.calls["pcie_link"] == 2


# -- GPM ---------------------------------------------------------------------------------------

GPM_SERIES = ("openlora.gpu.sm.activity", "openlora.gpu.sm.occupancy", "openlora.gpu.tensor.activity")


def test_gpm_needs_two_snapshots_and_always_passes_the_older_sample_first(collect) -> None:
    [card] = h100s(1)
    fake = FakeNvml([card])
    reader, _ = build(fake)
    data = collect(reader)
    assert all(series(data, name) == [] for name in GPM_SERIES)  # absent, not zero
    for occupancy in (40.0, 12.5, 90.0):  # the fake refuses samples out of order or from another GPU
        card.gpm = {**card.gpm, GPM.SM_OCCUPANCY: occupancy}
        data = collect(reader)
        assert series(data, "openlora.gpu.sm.occupancy")[0][1] == occupancy / 100
    assert fake.calls["gpm_sample_alloc"] == 2  # two buffers, reused


def test_gpm_absent_before_hopper_and_not_asked_again(collect) -> None:
    fake = FakeNvml([older_gpu()])
    reader, _ = build(fake)
    for _ in range(3):
        data = collect(reader)
        assert all(series(data, name) == [] for name in GPM_SERIES)
    assert fake.calls["gpm_supported"] == 1 and fake.calls["gpm_sample_get"] == 0


def test_gpm_restarts_after_a_failed_snapshot(collect, monkeypatch) -> None:
    [card] = h100s(1)
    fake = FakeNvml([card])
    reader, _ = build(fake)
    collect(reader)
    assert series(collect(reader), "openlora.gpu.sm.activity")
    original = fake.gpm_sample_get
    monkeypatch.setattr(fake, "gpm_sample_get", lambda h, s: (_ for _ in ()).throw(GpuError("Unknown Error")))
    data = collect(reader)
    assert status(data) == {card.uuid: "failed"}
    monkeypatch.setattr(fake, "gpm_sample_get", original)
    data = collect(reader)
    assert series(data, "openlora.gpu.sm.activity") == []  # would span the failure: skipped
    assert series(collect(reader), "openlora.gpu.sm.activity")


# -- PCIe bytes ---------------------------------------------------------------------------------


def io_bytes(data) -> dict[str, float]:
    return by(data, "hw.gpu.io", "network.io.direction")


@pytest.fixture
def exact_seconds(stepped_time: SteppedTime, monkeypatch) -> None:
    """The GPU snapshots' clock exactly 1 s on per collect(), none of the real time between them."""
    monkeypatch.setattr(stepped_time, "monotonic", lambda: 1000.0 + stepped_time.offset)


def test_pcie_bytes_from_gpm_rates_do_not_wrap(collect, exact_seconds) -> None:
    """On a GPU with GPM PCIe traffic (Hopper and later) the bytes are its average rate times the time
    between samples, summed: 110 GiB over 3 s here, where a 32-bit field would have gone round 27 times."""
    [card] = h100s(1)
    card.gpm = {**card.gpm, GPM.PCIE_TX_PER_SEC: 50 * 1024.0, GPM.PCIE_RX_PER_SEC: 1024.0}  # MiB/s
    card.pcie_tx_bytes = 123  # what a wrapped field would say: never read
    fake = FakeNvml([card])
    reader, _ = build(fake)
    assert io_bytes(collect(reader)) == {}  # one GPM sample: no PCIe bytes yet
    expected = {"transmit": 0.0, "receive": 0.0}
    for tx_gib_s in (50, 50, 10):  # the stepped clock: 1 s between snapshots
        card.gpm = {**card.gpm, GPM.PCIE_TX_PER_SEC: tx_gib_s * 1024.0}
        data = io_bytes(collect(reader))
        expected = {"transmit": expected["transmit"] + tx_gib_s * 2**30, "receive": expected["receive"] + 2**30}
        assert data == expected
    assert data["transmit"] == 110 * 2**30


def test_a_gpm_sample_missed_adds_nothing_and_the_counter_never_goes_back(
    collect, exact_seconds, monkeypatch
) -> None:
    [card] = h100s(1)
    card.gpm = {**card.gpm, GPM.PCIE_TX_PER_SEC: 1024.0, GPM.PCIE_RX_PER_SEC: 1024.0}
    fake = FakeNvml([card])
    reader, _ = build(fake)
    collect(reader)
    before = io_bytes(collect(reader))["transmit"]
    original = fake.gpm_sample_get
    monkeypatch.setattr(fake, "gpm_sample_get", lambda h, s: (_ for _ in ()).throw(GpuError("Unknown Error")))
    collect(reader)  # the GPU is failed this time: no values
    monkeypatch.setattr(fake, "gpm_sample_get", original)
    after_gap = io_bytes(collect(reader))["transmit"]  # a first sample again: the gap's bytes are unknown
    assert after_gap == before
    assert io_bytes(collect(reader))["transmit"] == before + 2**30


@pytest.mark.parametrize("with_gpm", [True, False], ids=["gpm", "fields"])
def test_a_gpu_lost_and_found_again_starts_its_pcie_bytes_over(collect, exact_seconds, with_gpm: bool) -> None:
    """A GPU that stopped answering (and was perhaps reset) adds nothing for the outage: GPM's next
    difference would span it, and a reset zeroes the fields, which is not a wrap."""
    [card] = h100s(1, gpm={GPM.PCIE_TX_PER_SEC: 1024.0, GPM.PCIE_RX_PER_SEC: 0.0} if with_gpm else None)
    card.pcie_tx_bytes = 3 * 2**30
    fake = FakeNvml([card])
    reader, _ = build(fake)
    collect(reader)
    before = io_bytes(collect(reader))["transmit"]
    card.failing = True
    for _ in range(5):  # 5 s without an answer
        assert status(collect(reader)) == {card.uuid: "failed"}
    card.failing = False
    card.pcie_tx_bytes = 2**30  # reset: zeroed, then 1 GiB since
    after = io_bytes(collect(reader)).get("transmit")
    if with_gpm:
        assert after == before  # a first sample again: nothing for the outage
        assert io_bytes(collect(reader))["transmit"] == before + 2**30  # then 1 s at 1 GiB/s
    else:
        assert after == 2**30  # down: a reset, not a wrap worth 4 GiB


def test_a_gpu_whose_gpm_went_away_reports_no_pcie_bytes_rather_than_a_frozen_count(
    collect, exact_seconds, monkeypatch
) -> None:
    [card] = h100s(1, gpm={GPM.PCIE_TX_PER_SEC: 1024.0, GPM.PCIE_RX_PER_SEC: 0.0})
    fake = FakeNvml([card])
    reader, _ = build(fake)
    collect(reader)
    assert io_bytes(collect(reader))["transmit"] == 2**30
    monkeypatch.setattr(fake, "gpm_sample_get", lambda h, s: (_ for _ in ()).throw(nvml.GpuNotSupported("Not Supported")))
    assert io_bytes(collect(reader)) == {}
    assert io_bytes(collect(reader)) == {}


def test_a_32_bit_pcie_field_going_down_is_one_wrap_and_a_bigger_one_a_reset(collect) -> None:
    """Without GPM PCIe traffic the fields are read: a value under 2^32 that went down went round once
    (right while under 4 GiB cross between snapshots); a value over 2^32 cannot have wrapped there."""
    [card] = h100s(1, gpm=None)
    card.pcie_tx_bytes = 2**32 - 1000
    card.pcie_rx_bytes = 7_000_000_000
    fake = FakeNvml([card])
    reader, _ = build(fake)
    assert io_bytes(collect(reader)) == {"transmit": 2**32 - 1000, "receive": 7_000_000_000}
    card.pcie_tx_bytes, card.pcie_rx_bytes = 500, 6_000_000_000
    assert io_bytes(collect(reader)) == {"transmit": 2**32 + 500, "receive": 6_000_000_000}
    card.pcie_tx_bytes = 2**32 - 10
    assert io_bytes(collect(reader)) == {"transmit": 2 * 2**32 - 10, "receive": 6_000_000_000}
    card.pcie_tx_bytes = 20
    assert io_bytes(collect(reader))["transmit"] == 2 * 2**32 + 20


def test_a_failed_second_gpm_allocation_frees_the_first(collect, monkeypatch) -> None:
    [card] = h100s(1)
    fake = FakeNvml([card])
    reader, _ = build(fake)
    original = fake.gpm_sample_alloc
    allocations = []

    def alloc_once_then_fail():
        if allocations:
            raise GpuError("Insufficient Memory")
        allocations.append(original())
        return allocations[-1]

    monkeypatch.setattr(fake, "gpm_sample_alloc", alloc_once_then_fail)
    collect(reader)
    assert len(allocations) == 1 and allocations[0].freed


# -- threads, shutdown -------------------------------------------------------------------------


def test_every_nvml_call_of_a_collection_runs_on_the_helper_thread(collect) -> None:
    fake = FakeNvml(h100s(2))
    reader, _ = build(fake)
    collect(reader)
    fake.inject_xid(fake.gpus[0], 79)
    collect(reader)
    assert set(fake.threads) == {"openlora-otel-nvml"}
    assert threading.current_thread().name not in fake.threads


def test_close_frees_the_event_set_and_samples_once_the_snapshot_in_flight_ends(collect) -> None:
    fake = FakeNvml(h100s(1))
    reader, metrics = build(fake, timeout_s=0.05)
    collect(reader)
    fake.latency_s = 0.02  # the next snapshot (about 0.2 s) is still running when close() comes
    collect(reader)
    metrics.collector.close()
    assert fake.freed_event_sets == 0  # not under the running snapshot's feet
    deadline = threading.Event()
    for _ in range(250):
        if fake.freed_event_sets:
            break
        deadline.wait(0.02)
    assert fake.freed_event_sets == 1 and all(s.freed for s in fake.samples)
    calls = fake.total_calls
    collect(reader)
    assert fake.total_calls == calls  # closed: no new snapshot


# -- the real backend over a pynvml stand-in ----------------------------------------------------


def test_real_backend_field_values_pass_the_scope_and_convert_by_value_type() -> None:
    module = fake_pynvml_module(field_status={FI.REMAPPED_COR: 3})
    backend = PynvmlBackend(module)
    fields = [
        (FI.POWER_AVERAGE, 0),
        (FI.TOTAL_ENERGY_CONSUMPTION, 0),
        (FI.NVLINK_THROUGHPUT_DATA_TX, SCOPE_ALL_LINKS),
        (FI.REMAPPED_COR, 0),
        (FI.GET_GPU_RECOVERY_ACTION, 0),  # unknown to this "driver"
    ]
    assert backend.field_values("handle0", fields) == [
        (0, 312_456),
        (0, 987_654_321),
        (0, 5_000_000),  # the aggregate: the scope travelled as a tuple
        (3, None),
        (2, None),
    ]
    assert module.asked_fields == [fields]


def test_real_backend_health_calls() -> None:
    backend = PynvmlBackend(fake_pynvml_module(xids=[79, 13]))
    assert backend.pcie_replay_counter("handle0") == 4
    assert backend.remapped_rows("handle0") == (3, 1, 1, 0)
    assert backend.violation_s("handle0", PERF_POLICY.POWER) == 1.25  # ns to s
    assert backend.violation_s("handle0", PERF_POLICY.SYNC_BOOST) == 3.75
    assert backend.pcie_link("handle0") == (8, 4)
    assert backend.pcie_link_max("handle0") == (16, 5)
    event_set = backend.event_set_create()
    backend.register_xid_events("handle0", event_set)
    uuid = "GPU-abcdef01-0000-0000-0000-000000000000"
    assert [backend.wait_xid(event_set) for _ in range(3)] == [(uuid, 79), (uuid, 13), None]
    backend.event_set_free(event_set)


def test_real_backend_names_an_xid_gpu_without_asking_the_gpu_again() -> None:
    # An XID 79 GPU is off the bus: asking it for its UUID may fail, and the event must still count.
    module = fake_pynvml_module(xids=[79])
    backend = PynvmlBackend(module)
    event_set = backend.event_set_create()
    backend.register_xid_events("handle0", event_set)

    def lost(handle):
        raise module.NVMLError("GPU is lost")

    module.nvmlDeviceGetUUID = lost
    assert backend.wait_xid(event_set) == ("GPU-abcdef01-0000-0000-0000-000000000000", 79)
    # pynvml's handles are ctypes pointers: a new pointer object to the same device is the same GPU.
    device = ctypes.c_int(0)
    assert nvml._handle_key(ctypes.pointer(device)) == nvml._handle_key(ctypes.pointer(device))


def test_real_backend_gpm_metrics() -> None:
    module = fake_pynvml_module()
    backend = PynvmlBackend(module)
    assert backend.gpm_supported("handle0")
    first, second = backend.gpm_sample_alloc(), backend.gpm_sample_alloc()
    backend.gpm_sample_get("handle0", first)
    backend.gpm_sample_get("handle0", second)
    metrics = backend.gpm_metrics(first, second, [GPM.SM_UTIL, GPM.DRAM_BW_UTIL, 999])
    assert metrics == {GPM.SM_UTIL: 87.5, GPM.DRAM_BW_UTIL: 55.0}  # 999 answered NotSupported: left out
    [(sample1, sample2, count)] = module.metrics_requests
    assert (sample1, sample2, count) == (first.value, second.value, 3)
    backend.gpm_sample_free(first)
    unsupported = PynvmlBackend(fake_pynvml_module(not_supported={"nvmlGpmQueryDeviceSupport"}))
    with pytest.raises(nvml.GpuNotSupported):
        unsupported.gpm_supported("handle0")


def test_an_older_driver_lacking_an_nvml_entry_point_is_not_a_lost_gpu(collect) -> None:
    # A driver older than GPM (R520) or the row remapper (R450) has no such symbol in libnvidia-ml;
    # a current nvidia-ml-py then raises FunctionNotFound: the capability is absent, the GPU is fine.
    module = fake_pynvml_module(
        missing={"nvmlGpmQueryDeviceSupport", "nvmlDeviceGetRemappedRows"},
        field_status={FI.REMAPPED_COR: 2, FI.REMAPPED_UNC: 2, FI.REMAPPED_PENDING: 2, FI.REMAPPED_FAILURE: 2},
    )
    backend = PynvmlBackend(module)
    with pytest.raises(nvml.GpuNotSupported):
        backend.gpm_supported("handle0")
    reader, _ = build(backend)
    for _ in range(2):
        data = collect(reader)
        assert status(data) == {"GPU-abcdef01-0000-0000-0000-000000000000": "ok"}
        assert series(data, "hw.gpu.memory.usage")
        assert series(data, "openlora.gpu.remap.rows") == []
        assert series(data, "openlora.gpu.sm.activity") == []


# -- against the real nvidia-ml-py, where installed (no driver needed) -------------------------


def _class_ints(cls: type) -> dict[str, int]:
    return {k: v for k, v in vars(cls).items() if isinstance(v, int) and not k.startswith("_")}


def test_ids_and_structs_match_the_installed_pynvml() -> None:
    pynvml = pytest.importorskip("pynvml")
    for name, value in _class_ints(FI).items():
        assert getattr(pynvml, f"NVML_FI_DEV_{name}") == value, name
    for name, value in _class_ints(GPM).items():
        assert getattr(pynvml, f"NVML_GPM_METRIC_{name}") == value, name
    for name, value in _class_ints(PERF_POLICY).items():
        assert getattr(pynvml, f"NVML_PERF_POLICY_{name}") == value, name
    for name, value in _class_ints(RECOVERY).items():
        assert getattr(pynvml, f"NVML_GPU_RECOVERY_ACTION_{name}") == value, name
    assert pynvml.NVML_ERROR_NOT_SUPPORTED == nvml.NVML_ERROR_NOT_SUPPORTED
    assert pynvml.NVML_ERROR_INVALID_ARGUMENT == nvml.NVML_ERROR_INVALID_ARGUMENT
    assert pynvml.NVML_ERROR_GPU_IS_LOST == nvml.NVML_ERROR_GPU_IS_LOST
    assert len(fake_nvml.c_nvmlGpmMetricsGet_t().metrics) == pynvml.NVML_GPM_METRIC_MAX
    for ours, theirs in (
        (fake_nvml.c_nvmlFieldValue_t, pynvml.c_nvmlFieldValue_t),
        (fake_nvml.c_nvmlValue_t, pynvml.c_nvmlValue_t),
        (fake_nvml.c_nvmlGpmMetric_t, pynvml.c_nvmlGpmMetric_t),
        (fake_nvml.c_nvmlGpmMetricsGet_t, pynvml.c_nvmlGpmMetricsGet_t),
        (fake_nvml.c_nvmlViolationTime_t, pynvml.c_nvmlViolationTime_t),
    ):
        assert [f[0] for f in ours._fields_] == [f[0] for f in theirs._fields_], theirs.__name__
        assert ctypes.sizeof(ours) == ctypes.sizeof(theirs), theirs.__name__
    assert [f[0] for f in pynvml.c_nvmlEventData_t._fields_][:3] == ["device", "eventType", "eventData"]
    # Every pynvml name the backend uses exists in the real module, and in the stand-in.
    used = set(re.findall(r"self\._nv\.(\w+)", Path(nvml.__file__).read_text()))
    stand_in = fake_pynvml_module()
    for name in sorted(used):
        assert hasattr(pynvml, name), name
        assert hasattr(stand_in, name), name
