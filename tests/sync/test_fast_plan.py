"""The plan of a sync is sent once: later syncs with the same plan send its digest alone, a changed plan
(names / shapes, bucket size, mode) goes in full again, and a digest the receiver does not hold is
refused naming it, after which the plan goes in full.  One exporter is reused across syncs; the
trainer's parameters change in place between syncs, and the engine follows them bit for bit."""
import pytest

from megatron_omni.parallel.testing import run_distributed
from megatron_omni.sync import HFExporter, SyncError, engine_side
from tests.sync.fast_sync_harness import InProcessSync, bump, export, make_engine, same
from tests.sync.workers import WrongShape, trainer_model


def test_repeated_syncs_send_the_plan_once(single_rank):
    model = trainer_model(single_rank.tp_group, 0, 1, lora=False)
    link = InProcessSync(make_engine(single_rank.tp_group))
    exporter = HFExporter(model, single_rank.tp_group, mode="full", bucket_bytes=64 << 10)
    sent = []
    for _ in range(3):
        sent.append(link.sync(exporter, 16 << 10, checksum=True)["plan"])
        assert same(engine_side.held(link.engine, "full"), export(exporter))
        bump(model)  # an optimizer step: in place, so the exporter's references stay valid
    assert sent == ["full", "digest", "digest"]
    assert all(r["checksums"] == 77 for r in link.received)


def test_a_changed_plan_is_sent_in_full(single_rank):
    model = trainer_model(single_rank.tp_group, 0, 1)
    link = InProcessSync(make_engine(single_rank.tp_group))
    merged = HFExporter(model, single_rank.tp_group, mode="merged")
    full = HFExporter(model, single_rank.tp_group, mode="full")
    steps = [(merged, 16 << 10), (merged, 16 << 10), (merged, 64 << 10), (merged, 64 << 10), (full, 64 << 10),
             (merged, 64 << 10)]
    sent = [link.sync(exporter, bucket)["plan"] for exporter, bucket in steps]
    assert sent == ["full", "digest", "full", "digest", "full", "full"]  # bucket size, then mode changed
    assert same(engine_side.held(link.engine, "full"), export(merged))
    # other names / shapes: refused before any byte moved (the engine keeps its weights), then the good
    # plan goes in full again, since the sender cannot know what the receivers kept
    before = engine_side.held(link.engine, "full")
    with pytest.raises(SyncError, match="has shape"):
        link.sync(WrongShape(merged), 64 << 10)
    assert same(engine_side.held(link.engine, "full"), before)
    bump(model)
    assert link.sync(merged, 64 << 10)["plan"] == "full"
    assert same(engine_side.held(link.engine, "full"), export(merged))


def test_an_unknown_digest_is_refused_naming_it_then_sent_in_full(single_rank):
    model = trainer_model(single_rank.tp_group, 0, 1)
    link = InProcessSync(make_engine(single_rank.tp_group))
    exporter = HFExporter(model, single_rank.tp_group, mode="merged")
    link.sync(exporter, 64 << 10)
    digest = link.tx.plans.known[0].digest
    link.rx.plans.known.clear()  # the receiver lost the plan (it cannot, but the sender must not rely on it)
    with pytest.raises(SyncError, match=f"sent plan digest {digest}, which this rank does not hold"):
        link.sync(exporter, 64 << 10)
    bump(model)
    assert link.sync(exporter, 64 << 10)["plan"] == "full"
    assert same(engine_side.held(link.engine, "full"), export(exporter))


# ---- two senders and an engine over a gloo group --------------------------------------------------------------

def _two_senders_one_engine(state, port: int) -> dict:
    """Ranks 0 and 1 each send half the model (as two pipeline stages would), rank 2 is the engine."""
    from megatron_omni.sync import GroupChannel, receive_weights, send_weights

    channel = GroupChannel("127.0.0.1", port, state.rank, 3, timeout_s=30)
    model = trainer_model(state.tp_group, 0, 1)
    exporter = HFExporter(model, state.tp_group, mode="merged", bucket_bytes=16 << 10)
    names = [m.name for m in exporter.plan()]
    whole = export(exporter)
    out = {"plans": []}
    for _ in range(3):
        if state.rank < 2:  # sender s streams every other tensor of the export
            mine = [m for i, m in enumerate(exporter.plan()) if i % 2 == state.rank]
            pairs = ((n, t) for i, (n, t) in enumerate(exporter.tensors()) if i % 2 == state.rank)
            out["plans"].append(send_weights(channel, state.rank, 2, mine, pairs, 16 << 10, "merged")["plan"])
        else:
            engine = out.setdefault("engine", make_engine(state.tp_group))
            mode = {}

            def check(m, plan):
                mode["m"] = m
                return engine_side.check_plan(engine, m, plan)

            receive_weights(channel, 2, check, lambda p: engine_side.load(engine, mode["m"], p))
            out["equal"] = same(engine_side.held(engine, "full"), whole) and len(whole) == len(names)
        bump(model)
        whole = export(exporter)
    out.pop("engine", None)
    channel.close()
    return out


def test_two_senders_send_digests_over_a_gloo_group():
    from megatron_omni.parallel.state import free_port

    out = run_distributed(_two_senders_one_engine, world_size=3, args=(free_port(),), parallel={}, timeout_s=240)
    assert out[0]["plans"] == out[1]["plans"] == ["full", "digest", "digest"]
    assert out[2]["equal"]
