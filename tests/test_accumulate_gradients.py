"""accumulate_gradients: a stage's weight-gradient matmuls accumulate into buffers over the
micro-batches of a step, and give what summing the untouched programs' outputs gives."""

from __future__ import annotations

import pytest
import torch
from hypothesis import Phase, given, settings
from hypothesis import strategies as st

from fxspeed.passes.program.accumulate_gradients import accumulate_gradients, accumulate_stage_gradients
from fxspeed.passes.program.split_stages import split_stages
from tests.workers.common import captured_gpt_step


def _stages(layers: int, width: int, rows: int, P: int, precision: str = "fp32"):
    model, _, cap = captured_gpt_step(layers, width, rows, precision)
    params = dict(model.named_parameters(remove_duplicate=False))
    return split_stages(cap.gm, cap.signature, min(P, layers + 2)), params


def _backward_inputs(progs, params, batches):
    """For each micro-batch, each stage's backward inputs (state, batch, saved, received gradient)."""
    per_mb = []
    for batch in batches:
        acts, saved = [], {}
        for p in progs:
            outs = p.forward(*[params[s.target] for s in p.state], *batch, *acts)
            k = len(p.send_f)
            acts, saved[p.stage] = list(outs[:k]), list(outs[k:k + p.n_saved])
        ins, g = {}, []
        for p in reversed(progs):
            ins[p.stage] = [*[params[s.target] for s in p.state], *batch, *saved[p.stage], *g]
            g = list(p.backward(*ins[p.stage]))[:len(p.send_b)]
        per_mb.append(ins)
    return per_mb


# No shrinking: each example compiles a GPT, and shrinking a failure took minutes.
@settings(max_examples=8, deadline=None, derandomize=True, phases=(Phase.explicit, Phase.generate))
@given(layers=st.integers(1, 3), width=st.sampled_from([16, 32]), rows=st.sampled_from([2, 4]),
       stages=st.integers(2, 4), microbatches=st.integers(1, 4), split=st.booleans())
def test_for_random_gpts_accumulating_into_buffers_equals_summing_each_micro_batch_s_gradients(
        layers: int, width: int, rows: int, stages: int, microbatches: int, split: bool) -> None:
    progs, params = _stages(layers, width, rows, stages)
    with torch.no_grad():  # as the runtime runs stage programs (out= ops refuse autograd)
        _check_accumulation(progs, params, rows, microbatches, split)


def _check_accumulation(progs, params, rows: int, microbatches: int, split: bool) -> None:
    g = torch.Generator().manual_seed(2)
    batches = [[torch.randint(0, 64, (rows, 8), generator=g) for _ in range(2)] for _ in range(microbatches)]
    per_mb = _backward_inputs(progs, params, batches)
    fused_any = False
    for p in progs:
        q = accumulate_stage_gradients(p)
        k = len(p.send_b)
        # Every Linear weight's gradient is an mm, every embedding's an embedding backward: all
        # of them go into buffers (the GPT's embeddings have no padding index).
        tables = {n for n in p.grads if n.endswith(".weight") and params[n].dim() == 2}
        assert tables <= set(q.grads_into), (p.stage, tables - set(q.grads_into))
        assert set(q.grads) | set(q.grads_into) == set(p.grads) and not set(q.grads) & set(q.grads_into)
        fused_any |= bool(q.grads_into)
        # NaN-filled buffers: the first micro-batch (beta 0) must not read them.
        bufs = [torch.full(m.shape, float("nan"), dtype=m.dtype) for m in q.grads_into_meta]
        want: dict[str, torch.Tensor] = {}
        for mb, ins in enumerate(per_mb):
            ref = list(p.backward(*ins[p.stage]))
            for name, t in zip(p.grads, ref[k:]):
                want[name] = t if mb == 0 else want[name] + t
            into = [0.0 if mb == 0 else 1.0, *bufs] if q.grads_into else []
            if split and q.backward_weight is not None:
                i_out = list(q.backward_input(*ins[p.stage]))
                got = i_out[:k] + list(q.backward_weight(*ins[p.stage], *i_out[k:], *into))
            else:
                got = list(q.backward(*ins[p.stage], *into))
            for a, b in zip(got[:k], ref[:k]):  # the message upstream is untouched
                assert torch.equal(a, b)
            for name, t in zip(q.grads, got[k:]):
                assert torch.equal(t, dict(zip(p.grads, ref[k:]))[name]), name
        for name, buf in zip(q.grads_into, bufs):
            # One micro-batch: the same GEMM, bit for bit. More: the GEMM adds into the running
            # sum instead of a separate add, which may round differently in the last bit; so
            # may the embeddings' row scatter-add, which sums repeated tokens in another order.
            if microbatches == 1 and not name.startswith(("wte", "wpe")):
                assert torch.equal(buf, want[name]), name
            else:
                torch.testing.assert_close(buf, want[name], rtol=1e-6, atol=1e-7, msg=name)
    assert fused_any


def test_a_program_without_matmul_gradients_is_returned_unchanged() -> None:
    gm = torch.fx.symbolic_trace(lambda x, y: (x * 2, y.sum(0)))
    out, fused, metas = accumulate_gradients(gm, 1, ["b"])
    assert out is gm and fused == [] and metas == []


def test_gradients_of_reduced_precision_matmuls_are_left_as_outputs() -> None:
    # Under bf16 the weight gradient is cast back to fp32 after the mm: not a bare mm chain.
    progs, _ = _stages(2, 16, 2, 2, precision="bf16")
    for p in progs:
        q = accumulate_stage_gradients(p)
        assert all(m.dtype == torch.float32 for m in q.grads_into_meta)
        for name in q.grads_into:
            assert name in p.grads


@pytest.mark.parametrize("n", [1, 2])
def test_the_number_of_fused_buffers_matches_the_program_s_new_inputs(n: int) -> None:
    progs, _ = _stages(n, 16, 2, 2)
    for p in progs:
        q = accumulate_stage_gradients(p)
        placeholders = lambda gm: [x for x in gm.graph.nodes if x.op == "placeholder"]  # noqa: E731
        if q.grads_into:
            assert len(placeholders(q.backward)) == len(placeholders(p.backward)) + 1 + len(q.grads_into)


def test_an_embedding_with_a_padding_index_keeps_its_gradient_as_an_output() -> None:
    emb = torch.nn.Embedding(10, 4, padding_idx=0)
    ids = torch.tensor([[0, 3, 3]])

    def backward(w: torch.Tensor, i: torch.Tensor, dy: torch.Tensor):  # noqa: ANN202
        return (torch.ops.aten.embedding_dense_backward(dy, i, 10, 0, False),
                torch.ops.aten.embedding_dense_backward(dy, i, 10, -1, False))

    gm = torch.fx.experimental.proxy_tensor.make_fx(backward)(emb.weight, ids, torch.ones(1, 3, 4))
    out, fused, _ = accumulate_gradients(gm, 0, ["padded", "plain"])
    assert fused == ["plain"]
    buf = torch.full((10, 4), float("nan"))
    with torch.no_grad():
        (padded,) = out(emb.weight, ids, torch.ones(1, 3, 4), 0.0, buf)
    assert padded[0].eq(0).all() and padded[3].eq(2).all()
    assert buf[3].eq(2).all() and buf[0].eq(1).all() and buf[1].eq(0).all()


def test_a_transposed_embedding_gradient_stays_an_output() -> None:
    # Rows are scattered into the buffer as the table is laid out: a transposed gradient is not.
    gm = torch.fx.experimental.proxy_tensor.make_fx(
        lambda i, dy: (torch.ops.aten.embedding_dense_backward(dy, i, 10, -1, False).t(),))(
        torch.tensor([[1, 2]]), torch.ones(1, 2, 4))
    out, fused, _ = accumulate_gradients(gm, 0, ["table"])
    assert out is gm and fused == []
