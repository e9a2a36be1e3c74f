"""The cost ledger's bookkeeping by hand: timers on an injected clock, merging, per-question
views, the saved file, the rich table and summed cost dicts."""
import pytest

from ragfast.accounting import ledger as cost
from ragfast.accounting.ledger import CostLedger, CostRecord, Timer, sum_cost_dicts


class FakeClock:
    """perf_counter stand-in: each call returns the next value."""

    def __init__(self, *values):
        self.values = list(values)

    def __call__(self):
        return self.values.pop(0)


def test_timer_reads_the_clock_at_enter_and_exit(monkeypatch):
    monkeypatch.setattr(cost.time, "perf_counter", FakeClock(10.0, 10.25))
    t = Timer()
    assert (t.device, t.seconds, t.device_seconds) == ("cpu", 0.0, 0.0)
    with t as entered:
        assert entered is t
    assert t.seconds == 0.25 and t.device_seconds == 0.0
    monkeypatch.setattr(cost.time, "perf_counter", FakeClock(3.0, 5.5))
    with CostLedger().timer("cpu") as t2:
        pass
    assert t2.seconds == 2.5 and t2.device == "cpu"


def _ledger():
    led = CostLedger()
    led.add("reasoner", "q1", input_tokens=10, output_tokens=2, flops=1.5e9, seconds=0.5)
    led.add("search", "q1", bytes_scanned=3_000_000)
    led.add("reasoner", None, flops=1e9)  # a cost of no question
    led.add_batch("judge", ["q1", "q2"], seconds=1.0, flops=[1e9, 3e9], input_tokens=[4, 6])
    return led


def test_merge_extend_and_per_question_views():
    led = _ledger()
    other = CostLedger()
    other.add_batch("judge", ["q2"], flops=[2e9])
    other.extend([CostRecord("nli", "q3", calls=2, flops=5.0)])
    led.merge(other)
    assert len(led.records) == 7 and led.batches == {"judge": 2}
    assert led.for_question("q2")["judge"]["flops"] == 5e9 and led.for_question("q2")["judge"]["calls"] == 2
    assert led.for_question("q2")["judge"]["seconds"] == pytest.approx(0.75)  # 3/4 of the batch by FLOPs
    assert led.for_question("nobody") == {}
    pq = led.per_question()
    assert set(pq) == {"q1", "q2", "q3"} and set(pq["q1"]) == {"reasoner", "search", "judge"}
    assert pq["q3"]["nli"]["calls"] == 2 and pq["q1"]["search"]["bytes_scanned"] == 3_000_000
    tot = led.totals()
    assert list(tot) == ["reasoner", "search", "judge", "nli", "total"]  # COMPONENTS order, then total
    assert tot["reasoner"]["flops"] == 2.5e9 and tot["reasoner"]["calls"] == 2 and tot["reasoner"]["tokens"] == 12
    assert tot["total"]["flops"] == 2.5e9 + 6e9 + 5.0 and tot["total"]["batches"] == 2
    assert led.to_json() == {"totals": tot, "per_question": pq}


def test_save_load_roundtrip(tmp_path):
    led = _ledger()
    led.save(tmp_path / "l.jsonl")
    lines = (tmp_path / "l.jsonl").read_text().splitlines()
    assert len(lines) == 5 and '"component": "reasoner"' in lines[0]
    back = CostLedger.load(tmp_path / "l.jsonl")
    assert back.records == led.records
    (tmp_path / "l.jsonl").write_text(lines[0][:-1] + ', "from_a_newer_version": 1}\n\n')
    assert CostLedger.load(tmp_path / "l.jsonl").records == led.records[:1]  # unknown fields, blank lines skipped


def test_table_rows():
    t = _ledger().table()
    assert t.title == "cost by component"
    cols = {c.header: c._cells for c in t.columns}
    assert cols["component"] == ["reasoner", "search", "judge", "total"]
    assert cols["calls"] == ["2", "1", "2", "5"] and cols["batches"] == ["0", "0", "1", "1"]
    assert cols["fresh tok"] == ["10", "0", "10", "20"] and cols["out tok"] == ["2", "0", "0", "2"]
    assert cols["GFLOPs"] == ["2.50", "0.00", "4.00", "6.50"] and cols["seconds"] == ["0.500", "0.000", "1.000", "1.500"]
    assert cols["MB scanned"] == ["0.0", "3.0", "0.0", "3.0"] and cols["cached tok"] == ["0"] * 4
    assert [c.justify for c in t.columns][:2] == ["left", "right"]
    assert CostLedger().table("x").title == "x"


def test_table_units_are_exactly_giga_and_mega():
    # values just above a rounding half: 2.1250000001 GFLOPs shows 2.13 and 1.250001 MB 1.3 only
    # when the divisors are exactly 1e9 and 1e6 (a divisor off by one part in 1e9 / 1e6 shows
    # 2.12 and 1.2)
    led = CostLedger()
    led.add("reasoner", "q", flops=2_125_000_000.1, bytes_scanned=1_250_001)
    cols = {c.header: c._cells for c in led.table().columns}
    assert cols["GFLOPs"] == ["2.13", "2.13"] and cols["MB scanned"] == ["1.3", "1.3"]


def test_sum_cost_dicts_by_hand():
    a = {"reasoner": {"calls": 1, "flops": 2.0}, "judge": {"calls": 2, "tokens": 5}}
    b = {"reasoner": {"calls": 3, "flops": 0.5}}
    got = sum_cost_dicts([a, b, {}])
    assert got["reasoner"]["calls"] == 4 and got["reasoner"]["flops"] == 2.5 and got["reasoner"]["seconds"] == 0
    assert got["judge"]["calls"] == 2 and got["judge"]["tokens"] == 5  # fields beyond the ledger's are summed too
    assert set(got) == {"reasoner", "judge"} and sum_cost_dicts([]) == {}


def test_tokens_count_cached_ones_too():
    led = CostLedger()
    led.add("reasoner", "q", input_tokens=1, cached_tokens=5, output_tokens=2)
    led.add("judge", "q", input_tokens=3)
    tot = led.totals()
    assert tot["reasoner"]["tokens"] == 8 and tot["judge"]["tokens"] == 3 and tot["total"]["tokens"] == 11


def test_add_batch_keeps_every_column_and_names_a_short_one():
    led = CostLedger()
    led.add_batch("reasoner", ["q1", "q2"], seconds=2.0, input_tokens=[10, 30], cached_tokens=[4, 0],
                  output_tokens=[1, 5], flops=[1.0, 3.0], bytes_scanned=[7, 9], unknown=[0, 1],
                  flops_uncached=[2.0, 3.0], calls=[2, 1])
    r1, r2 = led.records
    # every per-question column lands in its own record, as given
    assert (r1.input_tokens, r1.cached_tokens, r1.output_tokens, r1.bytes_scanned, r1.unknown) == (10, 4, 1, 7, 0)
    assert (r2.input_tokens, r2.cached_tokens, r2.output_tokens, r2.bytes_scanned, r2.unknown) == (30, 0, 5, 9, 1)
    assert (r1.flops, r2.flops, r1.flops_uncached, r2.flops_uncached) == (1.0, 3.0, 2.0, 3.0)
    assert (r1.calls, r2.calls) == (2, 1)
    # seconds split 1:3 by FLOPs; no device time was given, so none is recorded
    assert (r1.seconds, r2.seconds) == pytest.approx((0.5, 1.5))
    assert r1.device_seconds == 0.0 and r2.device_seconds == 0.0
    # a column of the wrong length is named in the error
    for name in ("input_tokens", "cached_tokens", "output_tokens", "flops", "bytes_scanned", "unknown", "reused",
                 "flops_uncached", "calls"):
        with pytest.raises(ValueError, match=rf"^judge: {name} has 1 entries for 2 questions$"):
            led.add_batch("judge", ["a", "b"], **{name: [1]})


def test_add_batch_splits_seconds_by_hand():
    led = CostLedger()
    # FLOPs summing below 1 still weigh (1:3); device seconds split the same way
    led.add_batch("judge", ["a", "b"], seconds=4.0, device_seconds=2.0, flops=[0.25, 0.75])
    # no FLOPs: weights are input + cached + output tokens, 2+1+1 : 3+0+5 = 4:8
    led.add_batch("judge", ["a", "b"], seconds=3.0, input_tokens=[2, 3], cached_tokens=[1, 0], output_tokens=[1, 5])
    # neither: even split
    led.add_batch("judge", ["a", "b"], seconds=2.0)
    # a call reused from cache takes no time: a's 2 calls, 1 reused -> weight 1 * 1/2 against b's 1 * 1
    led.add_batch("judge", ["a", "b"], seconds=3.0, flops=[1.0, 1.0], calls=[2, 1], reused=[1, 0])
    got = [(r.seconds, r.device_seconds) for r in led.records]
    want = [(1.0, 0.5), (3.0, 1.5), (1.0, 0.0), (2.0, 0.0), (1.0, 0.0), (1.0, 0.0), (1.0, 0.0), (2.0, 0.0)]
    assert got == [pytest.approx(w) for w in want]
    assert led.batches == {"judge": 4}


def test_add_batch_zero_call_entry_weighs_as_computed():
    # an entry with no calls has no reused share to remove: it weighs its FLOPs in full (1.0)
    # beside one whose 2 calls had 1 reused (1/2): 1 : 0.5 of 3 s
    led = CostLedger()
    led.add_batch("judge", ["a", "b"], seconds=3.0, flops=[1.0, 1.0], calls=[0, 2], reused=[0, 1])
    assert [r.seconds for r in led.records] == pytest.approx([2.0, 1.0])


class FakeCudaEvent:
    """torch.cuda.Event stand-in (this machine has no GPU; bench/gpu_suite.py times real events)."""

    log: list = []
    made: list = []

    def __init__(self, enable_timing=False):
        self.enable_timing = enable_timing
        self.recorded = False
        FakeCudaEvent.log.append(("new", enable_timing))
        FakeCudaEvent.made.append(self)

    def record(self):
        self.recorded = True
        FakeCudaEvent.log.append(("record", id(self)))

    def elapsed_time(self, end):
        # torch reports milliseconds between two recorded events
        assert self.recorded and end.recorded and self.enable_timing and end.enable_timing
        FakeCudaEvent.log.append(("elapsed", id(self), id(end)))
        return 1250.0


def test_timer_on_cuda_reads_the_events_in_seconds(monkeypatch):
    torch = pytest.importorskip("torch")
    FakeCudaEvent.log, FakeCudaEvent.made = [], []
    monkeypatch.setattr(torch.cuda, "Event", FakeCudaEvent)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: FakeCudaEvent.log.append(("sync",)))
    monkeypatch.setattr(cost.time, "perf_counter", FakeClock(1.0, 4.0))
    t = Timer("cuda:0")
    with t:
        start, end = FakeCudaEvent.made
        assert FakeCudaEvent.log == [("new", True), ("new", True), ("record", id(start))]
    # end recorded, then the device synchronised, then start -> end read: 1250 ms = 1.25 s
    assert FakeCudaEvent.log[3:] == [("record", id(end)), ("sync",), ("elapsed", id(start), id(end))]
    assert t.device_seconds == 1.25 and t.seconds == 3.0
    # a CPU timer touches no event
    FakeCudaEvent.log, FakeCudaEvent.made = [], []
    monkeypatch.setattr(cost.time, "perf_counter", FakeClock(0.0, 0.5))
    with Timer("cpu") as c:
        pass
    assert FakeCudaEvent.made == [] and FakeCudaEvent.log == [] and c.device_seconds == 0.0 and c.seconds == 0.5
