"""Rewrite passes, one per module, each a declared pass (see fxspeed.compiler.pass_manager).

Graph passes (`GraphPass`) rewrite the step graph. `default_pipeline()` is the order
compile_step runs them in:

    normalize_graph          drop detach/alias no-ops; SiLU's gradient back to silu_backward
    dedupe_tied_parameters   one input and one summed gradient per tied (shared) Parameter
    insert_casts             mixed precision: matmul/conv/attention in bf16/fp16, the rest fp32
    keep_weights_low         ZeRO-1/2/3 under bf16/fp16: low-precision working weights and gradients
                             as the step's inputs and outputs (fp32 master with the optimizer)
    keep_activations_low     bf16/fp16: what a low matmul makes stays low through the ops that follow it
    scale_loss               fp16: backward seeded with the dynamic loss scale (a graph input)
    eliminate_dead_code      drop values nothing reads (keeps random and mutating ops)
    shard_tensors            tensor parallelism: this tp rank's slices, local shapes, tp collectives
    reduce_gradients         bucketed async all-reduce / reduce-scatter of gradients (data parallel)
    wait_parameter_gathers   ZeRO-1/2: wait for each bucket's post-step all-gather at its first use
    shard_parameters         ZeRO-3: parameter shards as inputs, gathered before use, prefetched
    offload_parameters       ZeRO-3 with parameter offload: shards read from files ahead of their gathers
    step_buckets_in_backward the optimizer steps each reduced gradient bucket inside backward, while
                             the next bucket's collective runs (PassOptions.optimizer_store)
    reuse_buffers            gathered / flattened buckets written into a few reused workspaces

One more runs on one replica's training program without gradient buckets when the engine asks
for it (PassOptions.optimizer_store), after tensor parallelism and before the planner reads the
program:

    step_in_backward         the optimizer steps each bucket of parameters inside backward, and
                             their gradients die there instead of being returned

and one on every training program whose Config offloads activations (PassOptions.activation_store),
at the same point:

    offload_activations      saved activations leave the device after forward makes them and come
                             back ahead of backward's first reader

Six graph passes join the single-device list only when they have work (so the pass records of
other programs are unchanged), and are disabled by name like the rest:

    recompute_checkpointed   torch.utils.checkpoint regions (tagged at capture) recomputed in backward
    chunk_cross_entropy      vocabulary projection + cross-entropy (+ backward) as one op over row
                             chunks, where the fp32 logits would take >= 64 MiB
    select_attention_kernel  bf16/fp16 CUDA programs: memory-efficient attention (what fp32 capture
                             recorded) -> FlashAttention, forward and backward
    fuse_kernels             norms and their backward -> Triton kernels, on CUDA programs
    fuse_rotary              rotary embeddings (q, k) and their backward -> Triton kernels, where
                             fuse_kernels runs (under tensor parallelism too, after shard_tensors,
                             on this rank's heads)
    fuse_activations         SwiGLU / GELU (+ a bias add) and their backward -> Triton kernels, same

then one runs on every training program, under tensor parallelism after shard_tensors
(compile_step adds it; serving programs have no backward):

    recompute_pointwise      elementwise values backward reads (GELU/SiLU outputs, gate products,
                             casts) recomputed there from values it keeps anyway

and last, where fuse_kernels runs (tensor parallelism included):

    fuse_residual_norms      a residual add + the norm reading it, and the norm's backward + the add
                             accumulating the stream's gradient -> Triton kernels
    fold_norm_casts          a fused norm whose output is only cast to bf16/fp16 writes it in that dtype

and after those, on bf16/fp16 programs on a CPU without native arithmetic for that dtype (x86
without AVX-512 for bf16; without AVX512-FP16/AMX-FP16 for fp16; training and serving programs):

    upcast_cpu_compute       low-precision matmuls, convolutions and attention compute in fp32 from
                             the same rounded values and round their results back (5-100x faster
                             there than PyTorch's reference kernels)

The distributed passes read ctx.options (PassOptions: world_size, zero, group_name, ...) and do
nothing on one device.

Program passes (`ProgramPass`) map a distributed program (fxspeed.compiler.pass_manager.
DistributedProgram: the joint graph of one micro-batch, then its stage programs and schedule) to
a new one. compile_program runs PROGRAM_PASSES in this order after the single-device graph passes:

    lower_schedule           the schedule of actions per pipeline position (gpipe, 1f1b, interleaved, zb)
    gather_stage_weights     ZeRO-3: GATHER(s) / RELEASE(s) actions around each stage's actions
    split_stages             cut the joint graph into per-stage forward and backward programs
    split_backward           zero bubble: backward -> I (input gradients) + W (weight gradients)
                             for the stages the schedule runs I/W actions for
    accumulate_gradients     weight-gradient matmuls and embedding rows of this rank's stages
                             accumulate into persistent buffers
    offload_stage_activations  activation offload: OFFLOAD(s,m) after F(s,m), RELOAD(s,m) ahead of
                             its backward, where other compute actions run in between

They are verified, recorded and disabled by name (`Config.disable_passes`) like graph passes;
their names are in STAGE_PASS_NAMES.
"""

from __future__ import annotations

from fxspeed.compiler.pass_manager import GraphPass, ProgramPass

from .graph.dedupe_tied_parameters import dedupe_tied_parameters
from .graph.eliminate_dead_code import eliminate_dead_code
from .graph.insert_casts import insert_casts
from .graph.keep_activations_low import keep_activations_low
from .graph.keep_weights_low import keep_weights_low
from .graph.normalize_graph import normalize_graph
from .parallel.reduce_gradients import reduce_gradients
from .memory.offload_activations import offload_activations
from .memory.offload_parameters import offload_parameters
from .memory.reuse_buffers import reuse_buffers
from .memory.step_buckets_in_backward import step_buckets_in_backward
from .memory.step_in_backward import step_in_backward
from .graph.scale_loss import scale_loss
from .parallel.shard_parameters import shard_parameters
from .parallel.shard_tensors import shard_tensors
from .parallel.wait_parameter_gathers import wait_parameter_gathers
from .program.accumulate_gradients import accumulate_gradients_pass
from .program.gather_stage_weights import gather_stage_weights
from .program.offload_stage_activations import offload_stage_activations
from .program.lower_schedule import lower_schedule_pass
from .program.split_stages import split_backward_pass, split_stages_pass

# DCE after the casts: it removes the fp32 views (W^T) that only low-precision ops used to read.
SINGLE_DEVICE_PASSES = (normalize_graph, dedupe_tied_parameters, insert_casts, keep_weights_low, keep_activations_low,
                        scale_loss, eliminate_dead_code)
# shard_tensors first: the data-parallel buckets are then laid out over tp slices.
DISTRIBUTED_PASSES = (shard_tensors, reduce_gradients, wait_parameter_gathers, shard_parameters, offload_parameters,
                      step_buckets_in_backward, reuse_buffers)
ALL_PASSES: dict[str, GraphPass] = {p.name: p for p in (*SINGLE_DEVICE_PASSES, *DISTRIBUTED_PASSES)}
# The schedule first: it is cheap, and split_backward needs it to know which stages run I and W.
PROGRAM_PASSES: tuple[ProgramPass, ...] = (lower_schedule_pass, gather_stage_weights, split_stages_pass,
                                           split_backward_pass, accumulate_gradients_pass, offload_stage_activations)
STAGE_PASS_NAMES = tuple(p.name for p in PROGRAM_PASSES)


def default_pipeline() -> list[GraphPass]:
    return [*SINGLE_DEVICE_PASSES, *DISTRIBUTED_PASSES]


def program_pipeline() -> list[ProgramPass]:
    return list(PROGRAM_PASSES)


__all__ = ["ALL_PASSES", "DISTRIBUTED_PASSES", "PROGRAM_PASSES", "SINGLE_DEVICE_PASSES", "STAGE_PASS_NAMES",
           "accumulate_gradients_pass", "dedupe_tied_parameters", "default_pipeline", "eliminate_dead_code",
           "gather_stage_weights", "insert_casts", "keep_activations_low", "keep_weights_low", "lower_schedule_pass", "normalize_graph", "offload_activations", "offload_stage_activations", "program_pipeline", "reduce_gradients",
           "reuse_buffers", "scale_loss", "shard_parameters", "shard_tensors", "split_backward_pass", "split_stages_pass",
           "step_buckets_in_backward", "step_in_backward", "wait_parameter_gathers"]
