"""Split a graph over a device mesh.

Writes the rewritten graph to OUT and its shard manifest beside it (OUT
without extension + '.manifest.json'). Both are written atomically, and only
after the whole rewrite succeeded. IN is a .pb / .pbtxt GraphDef or a
SavedModel directory.
"""
import sys

from absl import flags

from tfsplit import constants
from tfsplit.commands import common

USAGE = "tfsplit rewrite IN -o OUT (--mesh tp=4 [--strategy megatron] | --plan plan.json)"
ARGS = (1, 1)
REQUIRED = ("output",)


def define_flags(fv):
  common.define_output(fv, "Where to write the rewritten graph (.pb/.pbtxt).")
  flags.DEFINE_string("mesh", "tp=2", "Mesh axes, e.g. tp=4, dp=2,tp=2 or dp=2,ep=2 (axes: dp, tp, pp, ep).", flag_values=fv)
  flags.DEFINE_integer("microbatches", 1, "Micro-batches per step (in-graph gradient "
                       "accumulation); the batch must divide by dp x microbatches.",
                       flag_values=fv)
  flags.DEFINE_integer("stages", 1, "Pipeline stages (adds a pp axis in front of "
                       "--mesh); stages are balanced by the cost model's op times plus the "
                       "activations crossing each cut.", flag_values=fv)
  flags.DEFINE_enum("schedule", "1f1b", list(constants.PIPELINE_SCHEDULES),
                    "Pipeline schedule (interleaved: Megatron's interleaved 1F1B over "
                    "--virtual-stages model chunks per stage; zb-h1, zb-h2: zero-bubble "
                    "schedules that run weight gradients apart from input gradients, "
                    "zb-h1 at 1f1b's peak memory, zb-h2 at about twice it).",
                    flag_values=fv)
  flags.DEFINE_integer("virtual-stages", 1, "Model chunks per pipeline stage for "
                       "--schedule interleaved (>= 2; --microbatches a multiple of "
                       "--stages); the layers are cut into stages x virtual-stages "
                       "chunks, chunk c on stage c % stages.", lower_bound=1,
                       flag_values=fv)
  flags.DEFINE_string("layers", None, "Explicit stage layer ranges, e.g. '0:3,3:6' "
                      "(half-open, over the layers with parameters; one per model chunk "
                      "with --virtual-stages).", flag_values=fv)
  flags.DEFINE_enum("strategy", "megatron", ["megatron", "none"],
                    "How to choose what to split.", flag_values=fv)
  flags.DEFINE_multi_string("annotate", [], "VARIABLE_GLOB=DIMS, e.g. "
                            "'*/fc1/kernel=-,tp' (one entry per dimension, '-' = "
                            "replicated); overrides the strategy.", flag_values=fv)
  flags.DEFINE_enum("devices", "cpu", ["cpu", "gpu"], "Device type of the mesh.",
                    flag_values=fv)
  flags.DEFINE_string("job", "localhost", "Job name in device strings.", flag_values=fv)
  flags.DEFINE_float("bucket-mb", 25.0, "Gradient bucket size in MiB: the gradient "
                     "all-reduces over dp are packed into buckets of at most this size, "
                     "one collective each; 0 keeps one all-reduce per gradient.",
                     lower_bound=0.0, flag_values=fv)
  flags.DEFINE_string("recompute", "none", "Recompute forward activations in the "
                      "backward pass instead of keeping them: none, blocks (each "
                      "repeated block keeps only its input), selective (the attention "
                      "cores), auto (sqrt(n) checkpoints over the blocks), or name "
                      "scopes 'scope1,scope2' (globs allowed, e.g. 'gpt/block_*').",
                      flag_values=fv)
  flags.DEFINE_integer("zero", 0, "Optimizer-state sharding over dp: 1 keeps 1/dp of "
                       "the optimizer slots per replica (gradients reduce-scattered, "
                       "updates all-gathered), 2 also each micro-batch's gradient sum, "
                       "3 (FSDP) also the weights, gathered just before they are read; "
                       "0 off. Needs a dp axis of 2 or more.", flag_values=fv)
  flags.DEFINE_integer("zero-prefetch", 1, "With --zero 3: how many layers ahead a weight "
                       "gather may run (1: layer i+1's while layer i computes).",
                       flag_values=fv)
  flags.DEFINE_boolean("zero-gather-compute-dtype", False, "With --zero 3 and mixed "
                       "precision: a weight read only cast to float16 is cast on its block "
                       "and gathered in float16 (half the bytes; bfloat16 stays float32).",
                       flag_values=fv)
  flags.DEFINE_enum("offload", "none", ["none", "optimizer"], "CPU offload: optimizer "
                    "keeps the optimizer slots and their update ops on each device's "
                    "host CPU (CPU:0 of its task), the weights on the device.",
                    flag_values=fv)
  flags.DEFINE_string("offload-device", None, "With --offload: one host device for every "
                      "mesh device, e.g. /job:localhost/replica:0/task:0/device:CPU:4 "
                      "(needed when the mesh is on this machine's CPUs).", flag_values=fv)
  flags.DEFINE_enum("gradient-reduce-dtype", None, ["bfloat16"], "Reduce float32 "
                    "gradients over dp in this dtype: half the bytes, each partial "
                    "gradient rounded to 8 significant bits (verify then holds updates to "
                    "bfloat16's spread, not float32's). Default: the graph's own dtype, "
                    "exact.", flag_values=fv)
  flags.DEFINE_boolean("sequence-parallel", False, "With the megatron strategy and a tp "
                       "axis: the norms, residual and bias adds between tensor-parallel "
                       "blocks run on 1/tp of the sequence (reduce-scatter and all-gather in "
                       "place of each forward all-reduce, the same bytes; their "
                       "activations divided by tp).", flag_values=fv)
  flags.DEFINE_boolean("split-embeddings", False, "With the megatron strategy and a tp "
                       "axis: embedding tables are split along their hidden dimension, "
                       "each lookup all-gathered once, so a large (tied) table is not held "
                       "by every device. Default: replicated.", flag_values=fv)
  flags.DEFINE_boolean("strict", False, "Refuse a split that does less than the mesh asks "
                       "(a tp or ep axis that splits no variable, a tp axis that splits under half of what its weight contractions read) instead of warning.",
                       flag_values=fv)
  flags.DEFINE_integer("batch", None, "The global batch of a graph traced with an unknown "
                       "batch dimension (inputs of shape [None, ...]): its inputs are bound "
                       "to it before the split, which needs static sizes.", lower_bound=1,
                       flag_values=fv)
  flags.DEFINE_float("collective-timeout", 600.0, "Seconds before a collective gives up "
                     "(a dead peer is then an error, not a hang).", flag_values=fv)
  flags.DEFINE_string("cluster", None, "Place the mesh on a cluster's worker tasks: "
                      "TF_CONFIG (the environment variable, as 'tfsplit launch' sets it) "
                      "or a JSON file (a TF_CONFIG or {\"worker\": [\"host:port\", ...]}); "
                      "devices are /job:worker/task:i/device:KIND:j.", flag_values=fv)
  flags.DEFINE_list("across-tasks", ["dp", "pp"], "With --cluster: mesh axes laid across "
                    "tasks; the others stay within a task.", flag_values=fv)
  flags.DEFINE_integer("devices-per-task", None, "With --cluster: devices of each task "
                       "(default: the cluster's tfsplit.devices_per_task, else 1).",
                       lower_bound=1, flag_values=fv)
  flags.DEFINE_integer("task", None, "With --cluster: write only this task's part of "
                       "the split (what a worker runs when every worker runs the script; "
                       "edges to other tasks become broadcasts); the manifest lists every "
                       "shard.", lower_bound=0, flag_values=fv)
  flags.DEFINE_string("plan", None, "A plan written by 'tfsplit plan': its mesh, "
                      "micro-batches, schedule, stage layer ranges, recompute and zero "
                      "replace those flags.", flag_values=fv)
  common.define_source(fv, "IN")


def run(fv, args):
  from tfsplit.commands import split_flags  # pylint: disable=import-outside-toplevel
  from tfsplit.runtime import rewrite  # pylint: disable=import-outside-toplevel
  graph_def = rewrite.load_source(args[0], fv.signature, fv.variables)
  config = split_flags.split_config(fv, graph_def, args[0])
  lines = rewrite.rewrite_file(args[0], fv.output, config, graph_def=graph_def)
  sys.stdout.write("\n".join(lines) + "\n")
  return 0
