"""kllm_plugins.bench.trace (Mooncake JSONL) and kllm_plugins.bench.schedule."""
import json

import pytest

from kllm_plugins.bench import schedule
from kllm_plugins.bench.trace import TraceRecord, read_trace, retime, token_ids, write_trace

ROWS = [{"timestamp": 0, "input_length": 700, "output_length": 5, "hash_ids": [0, 1], "session": 3},
        {"timestamp": 250, "input_length": 600, "output_length": 8, "hash_ids": [0, 2]}]


@pytest.mark.parametrize("name", ["t.jsonl", "t.jsonl.gz"])
def test_round_trip_keeps_fields_and_extra_keys(tmp_path, name):
    path = tmp_path / name
    path.write_bytes(b"") if False else None
    recs = [TraceRecord(r["timestamp"], r["input_length"], r["output_length"], tuple(r["hash_ids"]),
                        {k: v for k, v in r.items() if k == "session"}) for r in ROWS]
    write_trace(path, recs)
    back = read_trace(path)
    assert [b.to_json() for b in back] == ROWS
    assert back[1].arrival_s == 0.25


def test_shipped_mooncake_subset_parses():
    recs = read_trace("benchmarks/data/mooncake-fast25/conversation_trace_first1500.jsonl.gz", limit=50)
    assert len(recs) == 50 and all(r.hash_ids for r in recs)


def test_bad_lines_give_one_line_errors(tmp_path):
    p = tmp_path / "bad.jsonl"
    p.write_text(json.dumps({"timestamp": 0, "input_length": 3}) + "\n")
    with pytest.raises(ValueError, match=r"bad.jsonl:1: missing output_length, hash_ids"):
        read_trace(p)
    p.write_text("{not json\n")
    with pytest.raises(ValueError, match="not JSON"):
        read_trace(p)
    with pytest.raises(FileNotFoundError, match="no trace file"):
        read_trace(tmp_path / "absent.jsonl")


def test_token_ids_share_prefixes_and_fill_the_length():
    a, b = (TraceRecord(0, r["input_length"], 1, tuple(r["hash_ids"])) for r in ROWS)
    ta, tb = token_ids(a, block_size=512), token_ids(b, block_size=512)
    assert len(ta) == 700 and len(tb) == 600
    assert ta[:512] == tb[:512] and ta[512:600] != tb[512:600]
    assert token_ids(a, block_size=512, offset=10)[:512] != ta[:512]


def test_schedules_are_seeded_and_scaled():
    p = schedule.poisson(200, 4.0, seed=1)
    assert p == schedule.poisson(200, 4.0, seed=1) and p[0] == 0.0
    assert schedule.offered_rate(p) == pytest.approx(4.0, rel=0.25)
    s2, s4 = schedule.poisson(50, 2.0, 3, scaled=True), schedule.poisson(50, 4.0, 3, scaled=True)
    assert s2 == pytest.approx([2 * t for t in s4])
    assert schedule.constant(3, 2.0) == [0.0, 0.5, 1.0]
    g = schedule.gamma(400, 5.0, cv=2.0, seed=0)
    assert schedule.offered_rate(g) == pytest.approx(5.0, rel=0.35)
    assert schedule.from_timestamps([1000, 1500, 3000], slowdown=2.0) == [0.0, 1.0, 4.0]
    assert retime([TraceRecord(9, 1, 1, ())], [0.5])[0].timestamp == 500.0
    with pytest.raises(ValueError, match="rate must be > 0"):
        schedule.poisson(3, 0.0, 1)


def test_token_ids_stay_in_the_given_id_range() -> None:
    from kllm_plugins.bench.trace import TraceRecord, token_ids

    rec = TraceRecord(0.0, 40, 1, (3, 4))
    ids = token_ids(rec, block_size=16, vocab=3996, low=100)
    assert len(ids) == 40 and min(ids) >= 100 and max(ids) < 3996
    assert ids[:32] == token_ids(rec, block_size=16, vocab=3996, low=100)[:32]  # deterministic
    assert ids[:16] != token_ids(rec, block_size=16, vocab=3996, low=5)[:16]  # the range is part of the mapping
