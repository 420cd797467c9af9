"""Benchmark: activation memory of one tensor-parallel transformer block with
and without sequence parallelism, beside Korthikanti et al.'s formula.

The block is theirs (GPT-2, 16-bit activations, dropout after the attention
probabilities, the attention output and the MLP): LayerNorm, Q/K/V, scores,
softmax, dropout, attention over V, output projection, dropout, residual,
LayerNorm, fc1, GeLU, fc2, dropout, residual. The dropout masks are fed as
boolean inputs (1 byte an element, as their count has them), so the graph is
deterministic and the split and original agree exactly. Two blocks are
built; the second is measured (its input is the first block's output, split
over the sequence under sequence parallelism, as in a deep model).

Activation memory of a layer, as the formula counts it, is what the forward
pass keeps for the backward: per device, the bytes of every forward tensor
of the block that a backward op on that device reads (the rewritten graph's
roles; parameters excluded). The formula's bytes per layer are
s*b*h*(10 + 24/t + 5*a*s/(h*t)) without and s*b*h*(34/t + 5*a*s/(h*t)) with
sequence parallelism; the script prints both measured figures, the measured
ratio (without / with) and the formula's, and their relative difference.

    python tools/bench_sequence_parallel.py [--seq 64] [--batch 2] [--hidden 64]
        [--heads 4] [--tp 2]
"""
import collections
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from absl import app  # pylint: disable=g-import-not-at-top
from absl import flags  # pylint: disable=g-import-not-at-top

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

FLAGS = flags.FLAGS
flags.DEFINE_integer("seq", 64, "Sequence length s.")
flags.DEFINE_integer("batch", 2, "Batch size b.")
flags.DEFINE_integer("hidden", 64, "Hidden size h.")
flags.DEFINE_integer("heads", 4, "Attention heads a.")
flags.DEFINE_integer("tp", 2, "Tensor-parallel size t.")
flags.DEFINE_integer("blocks", 2, "Blocks built; the last is measured.")


def block_graph(s, b, h, a, blocks=2):
  """(GraphDef of one SGD training step, variable names) of `blocks` GPT-2 blocks."""
  import numpy as np  # pylint: disable=import-outside-toplevel
  import tensorflow as tf  # pylint: disable=import-outside-toplevel
  from tfsplit.graph import load_graph  # pylint: disable=import-outside-toplevel
  dt = tf.float16
  rng = np.random.default_rng(0)

  def var(shape, name):
    return tf.Variable(rng.normal(0, 0.05, shape).astype(np.float16), name=name)
  params = []
  for i in range(blocks):
    params.append({
        "g1": tf.Variable(np.ones(h, np.float16), name=f"block_{i}/ln_1/gamma"),
        "b1": tf.Variable(np.zeros(h, np.float16), name=f"block_{i}/ln_1/beta"),
        "q": var((h, h), f"block_{i}/attn/q"), "k": var((h, h), f"block_{i}/attn/k"),
        "v": var((h, h), f"block_{i}/attn/v"), "o": var((h, h), f"block_{i}/attn/o"),
        "g2": tf.Variable(np.ones(h, np.float16), name=f"block_{i}/ln_2/gamma"),
        "b2": tf.Variable(np.zeros(h, np.float16), name=f"block_{i}/ln_2/beta"),
        "fc1": var((h, 4 * h), f"block_{i}/mlp/fc1"),
        "fc2": var((4 * h, h), f"block_{i}/mlp/fc2"),
    })

  def layer_norm(x, g, beta):
    mean, variance = tf.nn.moments(x, axes=[-1], keepdims=True)
    return (x - mean) * tf.math.rsqrt(variance + 1e-5) * g + beta

  def dropout(x, keep):
    return tf.where(keep, x * tf.constant(1 / 0.9, dt), tf.zeros_like(x))

  def block(i, x, masks):
    p = params[i]
    with tf.name_scope(f"block_{i}"):
      with tf.name_scope("attn"):
        y = layer_norm(x, p["g1"], p["b1"])
        heads = lambda t: tf.transpose(tf.reshape(t, [b, s, a, h // a]), [0, 2, 1, 3])
        q, k, v = (heads(tf.einsum("bsh,hd->bsd", y, p[n])) for n in "qkv")
        scores = tf.einsum("bnsd,bntd->bnst", q, k) * tf.constant(1 / (h // a) ** 0.5, dt)
        probs = dropout(tf.nn.softmax(scores), masks[0])
        ctx = tf.reshape(tf.transpose(tf.einsum("bnst,bntd->bnsd", probs, v), [0, 2, 1, 3]),
                         [b, s, h])
        x = x + dropout(tf.einsum("bsh,hd->bsd", ctx, p["o"]), masks[1])
      with tf.name_scope("mlp"):
        y = layer_norm(x, p["g2"], p["b2"])
        y = tf.nn.gelu(tf.einsum("bsh,hf->bsf", y, p["fc1"]), approximate=True)
        return x + dropout(tf.einsum("bsf,fh->bsh", y, p["fc2"]), masks[2])

  variables = [v for p in params for v in p.values()]
  mask_specs = [tf.TensorSpec([b, a, s, s], tf.bool), tf.TensorSpec([b, s, h], tf.bool),
                tf.TensorSpec([b, s, h], tf.bool)] * blocks

  @tf.function(input_signature=[tf.TensorSpec([b, s, h], dt)] + mask_specs)
  def train_step(x, *masks):
    with tf.GradientTape() as tape:
      out = x
      for i in range(blocks):
        out = block(i, out, masks[3 * i:3 * i + 3])
      loss = tf.reduce_mean(tf.cast(out, tf.float32) ** 2)
    grads = tape.gradient(loss, variables)
    for v, g in zip(variables, grads):
      v.assign_sub(tf.constant(0.01, dt) * g)
    return loss
  concrete = train_step.get_concrete_function()
  names = [(v, v.name.split(":")[0]) for v in variables]
  return load_graph(concrete, variable_names=names)


def saved_bytes(graph_def, scope):
  """{device: bytes} of forward tensors under `scope` read by backward ops on
  the same device (parameters and constants excluded)."""
  from tfsplit.graph import Graph, infer_shapes  # pylint: disable=import-outside-toplevel
  from tfsplit.graph.layers import detect_layers  # pylint: disable=import-outside-toplevel
  from tfsplit import constants  # pylint: disable=import-outside-toplevel
  graph = Graph(graph_def)
  shapes = infer_shapes(graph)
  roles = detect_layers(graph, shapes).role
  kept = collections.Counter()
  for node in graph.nodes:
    if roles.get(node.name) != constants.FORWARD or scope not in node.name or \
        node.op in ("Const", "VarHandleOp") or node.op in constants.VARIABLE_READ_OPS:
      continue
    for port, info in enumerate(shapes[node.name] if node.name in shapes else []):
      if info is None or info.num_elements is None:
        continue
      readers = [c for c, _ in graph.consumers(node.name, port)
                 if roles.get(c) == constants.BACKWARD and
                 graph.node(c).device == node.device]
      if readers and not _is_weight(graph, node.name):
        kept[node.device] += info.num_bytes
  return kept


def _is_weight(graph, name):
  """Whether `name` is a view of a variable read (a weight, not an activation)."""
  node = graph.node(name)
  while node.op in ("Identity", "Cast", "Reshape", "Transpose") or node.op.startswith("Read"):
    if node.op.startswith("Read"):
      return True
    node = graph.node(node.input[0].split(":")[0].lstrip("^"))
  return node.op == "VarHandleOp"


def main(_):
  from tfsplit.passes import split_graph  # pylint: disable=import-outside-toplevel
  from tfsplit.strategies.sequence_parallel import activation_bytes as formula  # pylint: disable=import-outside-toplevel
  from tfsplit.runtime.split_function import make_mesh  # pylint: disable=import-outside-toplevel
  from tfsplit.runtime.devices import ensure_logical_devices  # pylint: disable=import-outside-toplevel
  s, b, h, a, t = FLAGS.seq, FLAGS.batch, FLAGS.hidden, FLAGS.heads, FLAGS.tp
  ensure_logical_devices(t)
  graph_def = block_graph(s, b, h, a, FLAGS.blocks)
  scope = f"block_{FLAGS.blocks - 1}/"
  measured = {}
  for sp in (False, True):
    result = split_graph(graph_def, make_mesh(f"tp={t}"), sequence_parallel=sp)
    per_device = saved_bytes(result.graph_def, scope)
    measured[sp] = max(per_device.values())
    kinds = collections.Counter(c.kind for c in result.collectives)
    print(f"sequence_parallel={sp!s:5}  kept for the backward per device: "
          f"{measured[sp] / 2**10:8.1f} KiB (formula {formula(s, b, h, a, t, sp) / 2**10:8.1f} "
          f"KiB)  collectives {dict(sorted(kinds.items()))}")
  ratio = measured[False] / measured[True]
  want = formula(s, b, h, a, t, False) / formula(s, b, h, a, t, True)
  print(f"s={s} b={b} h={h} a={a} t={t}: without / with sequence parallelism "
        f"measured {ratio:.3f}, formula {want:.3f} ({(ratio / want - 1) * 100:+.1f}%)")


if __name__ == "__main__":
  app.run(main)
