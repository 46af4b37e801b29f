"""Pipeline schedules: generators validate, simulate, round-trip as text, and match golden files.

Golden files in tests/golden/ were generated once and read by eye; to regenerate after an
intended change run `FXSPEED_UPDATE_GOLDEN=1 pytest tests/test_schedules.py` and review the diff.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fxspeed.errors import ConfigError
from fxspeed.ir.schedule import (Action, Schedule, ScheduleError, parse_action, validate)
from fxspeed.passes.program.gather_stage_weights import bracket
from fxspeed.passes.program.offload_stage_activations import MIN_ACTIONS_BETWEEN, bracket_activations
from fxspeed.passes.program.lower_schedule import SCHEDULES, gpipe, interleaved_1f1b, make, one_f_one_b, zero_bubble_h1
from fxspeed.planner.simulator import Costs, StageCosts, analytic_bubble, simulate

GOLDEN = Path(__file__).parent / "golden"
GOLDEN_CASES = {"gpipe": 1, "1f1b": 1, "interleaved-1f1b": 2, "zb-h1": 1}  # name -> v, all at P=4, M=8


@st.composite
def schedule_args(draw) -> tuple[str, int, int, int]:
    """A schedule name with P in 1..6, v in 1..3 and an M that the schedule accepts."""
    name = draw(st.sampled_from(SCHEDULES))
    P = draw(st.integers(1, 6))
    v = draw(st.integers(1, 3)) if name == "interleaved-1f1b" else 1
    if name == "interleaved-1f1b":
        M = P * draw(st.integers(1, 3))
    else:
        M = draw(st.integers(1, 12))
    return name, P, v, M


def per_rank_costs(sch: Schedule, v: int, **kw) -> Costs:
    """Equal work per rank: a chunk of an interleaved schedule costs 1/v of a whole stage."""
    return Costs.uniform(sch.n_stages, 1.0 / v, 1.0 / v, 1.0 / v, **kw)


# --- properties of every generated schedule -------------------------------------------------

@settings(max_examples=150, deadline=None)
@given(schedule_args())
def test_every_generated_schedule_validates_simulates_and_round_trips_as_text(args):
    name, P, v, M = args
    sch = make(name, P, M, v)
    validate(sch)
    # Also safe when a link buffers only two unreceived messages (interleaved with P=2 needs two:
    # both directions of that link carry activations and gradients).
    validate(sch, send_buffer=2)
    text = sch.format()
    again = Schedule.parse(text)
    assert again == sch
    assert again.format() == text
    res = simulate(sch, per_rank_costs(sch, v, p2p_latency=0.1))
    assert res.step_time > 0
    assert all(abs(b - M * 3.0) < 1e-9 for b in res.busy)  # each rank does M micro-batches of F+I+W
    assert 0.0 <= res.bubble < 1.0


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 6), st.integers(1, 12))
def test_gpipe_and_1f1b_bubbles_equal_the_analytic_value_with_equal_stage_costs(P, M):
    expected = analytic_bubble(P, M)
    for sch in (gpipe(P, M), one_f_one_b(P, M)):
        assert simulate(sch, Costs.uniform(P)).bubble == pytest.approx(expected, abs=1e-9)


@settings(max_examples=40, deadline=None)
@given(st.integers(2, 6), st.integers(2, 3), st.integers(1, 3))
def test_interleaving_divides_the_bubble_by_about_v(P, v, groups):
    M = P * groups
    inter = interleaved_1f1b(P, v, M)
    bubble = simulate(inter, per_rank_costs(inter, v)).bubble
    assert bubble == pytest.approx(analytic_bubble(P, M, v), abs=1e-9)
    plain = simulate(one_f_one_b(P, M), Costs.uniform(P)).bubble
    # bubble time shrinks by exactly v; the fraction by a little less (the step shrinks too)
    assert plain / v < bubble < plain / v * 1.5


@settings(max_examples=40, deadline=None)
@given(st.integers(2, 6), st.integers(1, 12))
def test_zero_bubble_h1_has_a_smaller_bubble_than_1f1b_at_the_same_memory(P, M):
    zb = simulate(zero_bubble_h1(P, M), Costs.uniform(P, weight_grad_fraction=1.0))
    plain = simulate(one_f_one_b(P, M), Costs.uniform(P))
    assert zb.bubble < plain.bubble
    assert max(zb.peak_activations) <= max(plain.peak_activations) <= P


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 6), st.integers(1, 12))
def test_1f1b_holds_at_most_P_micro_batches_while_gpipe_holds_all_M(P, M):
    assert max(simulate(one_f_one_b(P, M), Costs.uniform(P)).peak_activations) == min(P, M)
    assert simulate(gpipe(P, M), Costs.uniform(P)).peak_activations == [float(M)] * P


def test_zero_bubble_h1_bubble_is_a_third_of_1f1b_when_f_i_w_cost_the_same():
    # The ZB paper: 1F1B's bubble is (P-1)(F+B) per rank, ZB-H1's (P-1)(F+I-W).
    zb = simulate(zero_bubble_h1(4, 8), Costs.uniform(4))
    plain = simulate(one_f_one_b(4, 8), Costs.uniform(4))
    assert zb.idle[0] == pytest.approx(plain.idle[0] / 3)


def test_p2p_latency_lengthens_the_step_and_uneven_stages_set_the_pace():
    sch = one_f_one_b(4, 8)
    free = simulate(sch, Costs.uniform(4)).step_time
    assert simulate(sch, Costs.uniform(4, p2p_latency=0.5)).step_time > free
    slow = [StageCosts() for _ in range(4)]
    slow[2] = StageCosts(2.0, 2.0, 2.0)
    res = simulate(sch, slow)
    assert res.step_time >= 8 * 6.0  # the slow stage's own work
    assert res.idle[2] < min(res.idle[0], res.idle[1], res.idle[3])


# --- golden schedules -----------------------------------------------------------------------

@pytest.mark.parametrize("name", list(GOLDEN_CASES))
def test_generated_schedule_matches_its_golden_file(name):
    text = make(name, 4, 8, GOLDEN_CASES[name]).format()
    path = GOLDEN / f"{name}_P4_M8.txt"
    if os.environ.get("FXSPEED_UPDATE_GOLDEN"):
        path.parent.mkdir(exist_ok=True)
        path.write_text(text)
    assert text == path.read_text()
    validate(Schedule.parse(path.read_text()))


# --- bad inputs -----------------------------------------------------------------------------

@pytest.mark.parametrize("call, needle", [
    (lambda: gpipe(0, 8), "P=0"),
    (lambda: one_f_one_b(4, -1), "M=-1"),
    (lambda: zero_bubble_h1(4, 2.5), "M=2.5"),
    (lambda: interleaved_1f1b(4, 0, 8), "v=0"),
    (lambda: interleaved_1f1b(4, 2, 6), "M=6"),
    (lambda: make("pipedream", 4, 8), "'pipedream'"),
])
def test_bad_generator_arguments_raise_errors_naming_the_value(call, needle):
    with pytest.raises(ConfigError) as e:
        call()
    assert needle in str(e.value)


def test_interleaved_with_a_bad_M_says_which_M_would_work():
    with pytest.raises(ValueError, match=r"M=6 .* multiple of P=4.*M=4 or 8"):
        interleaved_1f1b(4, 2, 6)


def test_simulating_with_the_wrong_number_of_stage_costs_names_both_counts():
    with pytest.raises(ConfigError, match="3 stages.*has 4"):
        simulate(gpipe(4, 4), Costs.uniform(3))


@pytest.mark.parametrize("token", ["0X1", "SEND_F(0,1<-r1)", "RECV_B(0,1)", "REDUCE", "F"])
def test_unparseable_action_text_is_rejected_naming_the_token(token):
    with pytest.raises(ScheduleError, match=repr(token).replace("(", r"\(").replace(")", r"\)")):
        parse_action(token)


def test_actions_round_trip_through_their_text():
    for a in [Action("F", 0, 1), Action("W", 12, 30), Action("SEND_B", 3, 2, 2), Action("RECV_F", 1, 0, 0),
              Action("REDUCE", 2), Action("GATHER", 1), Action("RELEASE", 3), Action("OFFLOAD", 1, 2),
              Action("RELOAD", 0, 7), Action("STEP")]:
        assert parse_action(str(a)) == a


# --- the validator catches hand-broken schedules --------------------------------------------

def _edit(sch: Schedule, rank: int, fn) -> Schedule:
    """A copy of `sch` whose rank `rank` list is fn(list)."""
    acts = [list(a) for a in sch.actions]
    acts[rank] = fn(acts[rank])
    return Schedule(sch.name, sch.n_stages, sch.n_microbatches, sch.placement, acts)


def _raises(sch: Schedule, rule: str, rank: int) -> ScheduleError:
    with pytest.raises(ScheduleError) as e:
        validate(sch)
    assert e.value.rule == rule and e.value.rank == rank, str(e.value)
    assert f"rank {rank}, action {e.value.index}" in str(e.value)
    return e.value


def test_validator_reports_deadlock_when_a_recv_is_moved_above_the_send_it_waits_for():
    sch = one_f_one_b(4, 8)
    recv = Action("RECV_B", 0, 0, 1)
    broken = _edit(sch, 0, lambda a: [recv] + [x for x in a if x != recv])
    err = _raises(broken, "deadlock", 0)
    assert err.index == 0 and "RECV_B(0,0<-r1)" in str(err)


def test_validator_reports_mismatch_when_two_recvs_from_one_peer_are_swapped():
    sch = gpipe(2, 3)

    def swap(a: list[Action]) -> list[Action]:
        i, j = a.index(Action("RECV_F", 1, 0, 0)), a.index(Action("RECV_F", 1, 1, 0))
        a[i], a[j] = a[j], a[i]
        return a
    # now 1F0 runs after RECV_F(1,1) but before RECV_F(1,0): first the order rule must fire...
    _raises(_edit(sch, 1, swap), "order", 1)

    def swap_and_fix(a: list[Action]) -> list[Action]:
        a = [x for x in a if x.kind != "RECV_F"]
        return [Action("RECV_F", 1, 1, 0), Action("RECV_F", 1, 0, 0), Action("RECV_F", 1, 2, 0)] + a
    err = _raises(_edit(sch, 1, swap_and_fix), "match", 1)  # ...and with F still fed, the match rule
    assert "recv #0 from rank 0" in str(err) and "RECV_F(1,0)" in str(err)


def test_validator_reports_a_missing_weight_gradient():
    broken = _edit(zero_bubble_h1(4, 8), 2, lambda a: [x for x in a if x != Action("W", 2, 5)])
    err = _raises(broken, "once", 2)
    assert "2W5" in str(err)


def test_validator_reports_a_forward_that_runs_before_its_input_arrives():
    def hoist(a: list[Action]) -> list[Action]:
        i = a.index(Action("F", 1, 0))
        return [a[i]] + a[:i] + a[i + 1:]
    err = _raises(_edit(one_f_one_b(4, 8), 1, hoist), "order", 1)
    assert err.index == 0 and "RECV_F(1,0)" in str(err)


def test_validator_reports_a_backward_done_twice_and_a_wrong_peer():
    sch = one_f_one_b(2, 2)
    twice = _edit(sch, 1, lambda a: a[:-1] + [Action("B", 1, 0), a[-1]])
    assert "already done" in str(_raises(twice, "once", 1))
    wrong = _edit(interleaved_1f1b(3, 2, 3), 0, lambda a: [Action("SEND_F", x.stage, x.microbatch, 2)
                                                           if x.kind == "SEND_F" else x for x in a])
    assert "should be r1" in str(_raises(wrong, "placement", 0))


def test_rendezvous_sends_deadlock_1f1b_but_not_gpipe():
    # Unfused blocking sends: every rank sends before it receives in 1F1B's steady state.
    validate(gpipe(4, 8), send_buffer=0)
    with pytest.raises(ScheduleError, match="deadlock"):
        validate(one_f_one_b(4, 8), send_buffer=0)


def test_a_ranks_own_idle_fraction_counts_waiting_until_its_last_action_not_the_pipelines_end() -> None:
    from fxspeed.passes.program.lower_schedule import gpipe
    from fxspeed.planner.simulator import Costs, simulate

    # F = 1, B = I + W = 2. Rank 1 ends at 7 (its B0); rank 0 at 9 (B1 at 5..7, B0 at 7..9).
    r = simulate(gpipe(2, 2), Costs.uniform(2))
    assert r.finish == [9.0, 7.0] and r.busy == [6.0, 6.0]
    assert r.own_idle_fraction(0) == 3 / 9 and r.own_idle_fraction(1) == 1 / 7
    assert r.idle == [3.0, 3.0]  # the pipeline view: both wait until the step's end


# --- ZeRO-3's GATHER / RELEASE (passes/program/gather_stage_weights.py) ---------------------

@settings(max_examples=80, deadline=None)
@given(schedule_args())
def test_gathered_weights_bracket_every_action_of_their_stage_and_nothing_else_changes(args):
    name, P, v, M = args
    sch = make(name, P, M, v)
    got = bracket(sch)
    validate(got)
    assert Schedule.parse(got.format()) == got
    for r, acts in enumerate(got.actions):
        assert [a for a in acts if a.kind not in ("GATHER", "RELEASE")] == sch.actions[r]
        for s in sch.stages_of(r):
            staged = [i for i, a in enumerate(acts) if a.stage == s and a.kind not in ("GATHER", "RELEASE")]
            compute = [i for i, a in enumerate(acts) if a.stage == s and a.kind in ("F", "B", "I", "W")]
            gather = acts.index(Action("GATHER", s))
            release = acts.index(Action("RELEASE", s))
            assert gather == staged[0] - 1  # right before the stage's first action (a receive, often)
            assert release == compute[-1] + 1  # right after its last compute action
    # the simulator charges a GATHER its cost and a RELEASE nothing
    plain = simulate(sch, per_rank_costs(sch, v))
    timed = simulate(got, per_rank_costs(sch, v, gather=0.25))
    assert timed.step_time >= plain.step_time
    assert all(abs(b - (p + 0.25 * len(sch.stages_of(r)))) < 1e-9
               for r, (b, p) in enumerate(zip(timed.busy, plain.busy)))


def test_validator_reports_compute_outside_its_stages_gathered_weights_and_a_missing_release():
    sch = bracket(one_f_one_b(2, 2))
    # rank 0: GATHER(0) 0F0 ... : a forward moved above the gather
    e = _raises(_edit(sch, 0, lambda a: [a[1], a[0], *a[2:]]), "weights", 0)
    assert "before GATHER(0)" in str(e)
    # the release moved above the last backward
    def early_release(acts):
        i = acts.index(Action("RELEASE", 0))
        return acts[:i - 1] + [acts[i], acts[i - 1]] + acts[i + 1:]
    assert "after RELEASE(0)" in str(_raises(_edit(sch, 0, early_release), "weights", 0))
    e = _raises(_edit(sch, 1, lambda a: [x for x in a if x.kind != "RELEASE"]), "weights", 1)
    assert "RELEASE(1) is missing" in str(e)


# --- activation offload's OFFLOAD / RELOAD (passes/program/offload_stage_activations.py) ------

@settings(max_examples=80, deadline=None)
@given(schedule_args(), st.booleans())
def test_offloaded_activations_leave_after_their_forward_and_return_one_compute_action_before_their_backward(
        args, with_gathers):
    name, P, v, M = args
    sch = make(name, P, M, v)
    if with_gathers:  # both passes' actions together (ZeRO-3 with activation offload)
        sch = bracket(sch)
    got = bracket_activations(sch, set(range(sch.n_stages)))
    validate(got)
    validate(got, send_buffer=2)
    assert Schedule.parse(got.format()) == got
    moved = 0
    for r, acts in enumerate(got.actions):
        assert [a for a in acts if a.kind not in ("OFFLOAD", "RELOAD")] == sch.actions[r]
        compute = [(i, a) for i, a in enumerate(acts) if a.kind in ("F", "B", "I", "W")]
        for i, a in compute:
            if a.kind != "F":
                continue
            s, m = a.stage, a.microbatch
            back = next(j for j, b in compute if b.stage == s and b.microbatch == m and b.kind in ("B", "I"))
            between = [j for j, _ in compute if i < j < back]
            if len(between) >= MIN_ACTIONS_BETWEEN:
                moved += 1
                assert acts[i + 1] == Action("OFFLOAD", s, m)  # right after the forward
                reload = acts.index(Action("RELOAD", s, m))
                assert reload < between[-1] and all(acts[k].kind == "RELOAD" for k in range(reload, between[-1]))
            else:
                assert Action("OFFLOAD", s, m) not in acts and Action("RELOAD", s, m) not in acts
    # the simulator: no time, and a rank holds fewer micro-batches' activations at once
    plain, less = simulate(sch, per_rank_costs(sch, v)), simulate(got, per_rank_costs(sch, v))
    assert less.busy == plain.busy and less.step_time == plain.step_time
    assert all(a <= b for a, b in zip(less.peak_activations, plain.peak_activations))
    if moved and name == "gpipe" and M >= 4:  # gpipe holds all M: offload must lower the peak
        assert less.peak_activations[0] < plain.peak_activations[0]


def test_validator_reports_a_backward_reading_offloaded_activations_and_a_reload_without_offload():
    sch = bracket_activations(gpipe(2, 4), {0, 1})
    assert "OFFLOAD(0,0)" in sch.format()

    def drop(kind):
        return lambda acts: [a for a in acts if not (a.kind == kind and a.microbatch == 0)]

    e = _raises(_edit(sch, 0, drop("RELOAD")), "activations", 0)
    assert "RELOAD(0,0) must come before it" in str(e)
    e = _raises(_edit(sch, 0, drop("OFFLOAD")), "activations", 0)
    assert "not offloaded" in str(e)

    def offload_first(acts):  # OFFLOAD(0,0) moved above 0F0
        i = acts.index(Action("OFFLOAD", 0, 0))
        return [acts[i]] + acts[:i] + acts[i + 1:]

    assert "before 0F0 ran" in str(_raises(_edit(sch, 0, offload_first), "activations", 0))
