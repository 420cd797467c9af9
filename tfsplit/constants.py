"""Names shared across tfsplit: mesh axes, node roles, op families.

One home for each, so a pass never spells a role or an axis as a literal.
"""
import re

# --- mesh axes ------------------------------------------------------------------
DATA_AXIS = "dp"          # replicas, each on a slice of the batch
MICROBATCH_AXIS = "mb"    # micro-batches, run one after another on one device
PIPELINE_AXIS = "pp"      # pipeline stages
TENSOR_AXIS = "tp"        # operator splitting (Megatron)
EXPERT_AXIS = "ep"        # experts of a mixture-of-experts layer (and the batch elsewhere)
# The axes a user may name in a mesh; 'mb' is added by the rewrite itself.
USER_MESH_AXES = (DATA_AXIS, TENSOR_AXIS, PIPELINE_AXIS, EXPERT_AXIS)
# What splits the batch, outer first. 'ep' is the minor part, so a device's
# block of the batch under dp*mb*ep is its ep member's share of the dp*mb
# block: moving the split from the batch to the experts is one all-to-all
# over 'ep' (GShard's dispatch), within each micro-batch.
BATCH_AXES = (DATA_AXIS, MICROBATCH_AXIS, EXPERT_AXIS)
NON_MODEL_AXES = (DATA_AXIS, MICROBATCH_AXIS, PIPELINE_AXIS, EXPERT_AXIS)

# Gradient bucket cap of data-parallel all-reduces (PyTorch DDP's default,
# 25 MiB): the rewrite's default and what the planner prices.
DEFAULT_BUCKET_BYTES = 25 * 2**20

# --- roles of the nodes of a training step ----------------------------------------
FORWARD, BACKWARD, UPDATE = "forward", "backward", "update"
ROLES = (FORWARD, BACKWARD, UPDATE)
# Schedule block kinds: a forward (F) or backward (B) micro-batch block.
BLOCK_OF_ROLE = {FORWARD: "F", BACKWARD: "B"}
# The zero-bubble schedules split a backward block in two: B (the input
# gradients, on the critical path to the previous stage) and W (the weight
# gradients, which only the update waits for).
WEIGHT_GRADIENT_BLOCK = "W"
# Pipeline schedules by name (pipeline/schedules.py orders them; the
# simulator, the planner and the command lines accept these names).
PIPELINE_SCHEDULES = ("1f1b", "gpipe", "interleaved", "zb-h1", "zb-h2")
# Schedules that order B and W blocks apart.
ZERO_BUBBLE_SCHEDULES = ("zb-h1", "zb-h2")
# The share of a backward that computes weight gradients where nothing
# better is known: a dense layer's weight-gradient MatMul costs what its
# input-gradient one does.
DEFAULT_WEIGHT_FRACTION = 0.5

# --- op families ------------------------------------------------------------------
ASSIGN_OPS = frozenset(["AssignVariableOp", "AssignAddVariableOp", "AssignSubVariableOp"])
_WRITE_PREFIXES = ("Assign", "ResourceApply", "ResourceSparseApply", "ResourceScatter")
VARIABLE_READ_OPS = frozenset(["ReadVariableOp", "ResourceGather"])

# Gradient ops: GradientTape (TF2) or tf.gradients (TF1) scopes.
_GRADIENT_SCOPE = re.compile(r"^(gradient_tape|gradients(_\d+)?)/")


def is_write_op(op):
  """True for ops that write a variable (assignments and optimizer applies)."""
  return op.startswith(_WRITE_PREFIXES) and op != "Assert"


def gradient_scope_match(name):
  """The match of a gradient scope prefix at the start of `name`, or None."""
  return _GRADIENT_SCOPE.match(name)


def is_gradient_name(name):
  return _GRADIENT_SCOPE.match(name) is not None
