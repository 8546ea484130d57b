"""The timeline's phases are one IntEnum whose order the user-facing names and the per-step lists
follow; pending device steps are named records."""

from __future__ import annotations

from lightning_embcache.profiling import timeline
from lightning_embcache.profiling.timeline import NUM_PHASES, PHASES, PendingStep, Phase


def test_the_phase_constants_are_the_enums_values_in_the_names_order():
    assert [p.value for p in Phase] == list(range(NUM_PHASES + 1))
    assert [timeline.DATA, timeline.FORWARD, timeline.BACKWARD, timeline.OPTIMIZER, timeline.STORE,
            timeline.OTHER, timeline.VALIDATION] == list(Phase)
    names = {Phase.DATA: "data_wait", Phase.FORWARD: "forward", Phase.BACKWARD: "backward",
             Phase.OPTIMIZER: "optimizer", Phase.STORE: "store_io", Phase.OTHER: "other"}
    assert PHASES == tuple(names[Phase(i)] for i in range(NUM_PHASES))
    assert type(timeline.DATA) is int  # plain ints on the per-step paths


def test_a_pending_step_is_read_by_name():
    step = PendingStep(epoch=2, batches=1, host=[0.0] * 7, samples=4, steady=True, events=["a", "b"],
                       seg_phase=[Phase.FORWARD], seg_store=[0.0], forced=False, position=17)
    assert step.position == 17 and step.events[-1] == "b" and step._fields[-1] == "position"
