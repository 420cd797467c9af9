"""Keras 3's distribution API run by tfsplit: a ModelParallel's device mesh
and layout map (Keras's own matching) become the split's mesh and
annotations, a layout over the batch axis fully sharded data parallelism;
DataParallel is dp=N; a globally set distribution is picked up; bad
layouts are one line each."""
import logging
import re

import keras
import numpy as np
import pytest
from keras import distribution as kd

import tfsplit
from tfsplit.errors import PlanError

from _util import check_training, example
from test_keras_fit import check_fit

BATCH = 16


def _mesh(shape):
  return kd.DeviceMesh(shape, ("batch", "model"), devices=kd.list_devices()[:int(np.prod(shape))])


def _model_parallel(shape, layouts):
  layout_map = kd.LayoutMap(_mesh(shape))
  for key, layout in layouts.items():
    layout_map[key] = layout
  return kd.ModelParallel(layout_map=layout_map, batch_dim_name="batch")


def _mlp(seed=0):
  keras.utils.set_random_seed(seed)
  inputs = keras.Input((16,))
  h = keras.layers.Dense(32, activation="relu", name="dense")(inputs)
  h = keras.layers.Dense(32, activation="relu", name="dense_1")(h)
  return keras.Model(inputs, keras.layers.Dense(4, name="dense_2")(h), name="mlp")


def _fit(model, **split):
  rng = np.random.default_rng(0)
  x = rng.standard_normal((64, 16)).astype(np.float32)
  y = rng.integers(0, 4, 64)
  if split:
    model = tfsplit.keras.split(model, **split)
  model.compile(optimizer=keras.optimizers.Adam(1e-2),
                loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
  return model, model.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0).history


# Keras's model-parallel example: Dense kernels by columns, biases with them.
EXAMPLE = {".*dense.*kernel": (None, "model"), ".*dense.*bias": ("model",)}


def test_the_keras_model_parallel_example_fits_like_plain_fit():
  _, want = _fit(_mlp())
  model = _mlp()
  split_model, got = _fit(model, distribution=_model_parallel((2, 2), EXAMPLE))
  np.testing.assert_allclose(got["loss"], want["loss"], rtol=1e-5)
  step = split_model.split_step
  assert dict(step.mesh.axes) == {"dp": 2, "tp": 2}
  for v in model.variables:
    dims = step.manifest[v.path]["sharding"]
    assert dims == ([None, "tp"] if v.path.endswith("kernel") else ["tp"]), (v.path, dims)
  split_model.sync_weights()
  plain = _mlp()
  _fit(plain)
  for a, b in zip(plain.weights, model.weights):
    np.testing.assert_allclose(b.numpy(), a.numpy(), rtol=1e-4, atol=1e-6, err_msg=a.path)


# How model libraries publish Gemma/Llama layouts: each weight over both
# axes, the batch one making data parallelism fully sharded.
LLAMA = {
    ".*embed/embeddings": ("model", "batch"),
    ".*attn/(q|k|v)/kernel": ("batch", "model"),
    ".*attn/o/kernel": ("model", "batch"),
    ".*mlp/(gate|up)/kernel": ("batch", "model"),
    ".*mlp/down/kernel": ("model", "batch"),
    ".*lm_head/kernel": ("batch", "model"),
}


@pytest.mark.parametrize("shape", [(2, 2), (1, 4)])
def test_a_llama_layout_map_trains_exactly_as_laid_out(shape):
  batch, model = shape
  step = check_training(example("llama_keras3", batch_size=BATCH),
                        distribution=_model_parallel(shape, LLAMA))
  result = step.result
  assert result.config.zero == (3 if batch > 1 else 0)
  assert not result.fallbacks
  laid_out = 0
  for name, entry in result.manifest.items():
    layout = next((v for k, v in LLAMA.items() if re.fullmatch(k, name)), None)
    if layout is None:
      continue
    laid_out += 1
    want = [{"model": "tp" if model > 1 else None,
             "batch": "dp" if batch > 1 else None}[a] for a in layout]
    assert entry["sharding"] == want, (name, entry["sharding"], want)
    # Each device's bytes are what the layout says: the shape over the axes.
    for shard in entry["shards"]:
      assert shard["shape"] == [s // (shape[0] if a == "batch" else shape[1])
                                for s, a in zip(entry["shape"], layout)], (name, shard)
  assert laid_out == 2 + 4 * 7


def test_data_parallel_is_a_dp_mesh():
  model = _mlp()
  split_model, got = _fit(model, distribution=kd.DataParallel(devices=kd.list_devices()[:4]))
  _, want = _fit(_mlp())
  np.testing.assert_allclose(got["loss"], want["loss"], rtol=1e-5)
  step = split_model.split_step
  assert dict(step.mesh.axes) == {"dp": 4}
  assert all(e["sharding"] == [None] * len(e["shape"]) for e in step.manifest.values())


def test_a_globally_set_distribution_is_picked_up():
  _, want = _fit(_mlp())
  kd.set_distribution(_model_parallel((1, 2), EXAMPLE))
  try:   # set while the model is built and fit, as Keras's JAX examples do
    split_model, got = _fit(_mlp(), strategy=None)
  finally:
    kd.set_distribution(None)
  np.testing.assert_allclose(got["loss"], want["loss"], rtol=1e-5)
  assert dict(split_model.split_step.mesh.axes) == {"tp": 2}


def test_a_model_built_under_the_distribution_and_deferred_init_is_never_whole():
  """Built in distribution.scope() and tfsplit.deferred_init(): its variables
  hold nothing; each shard is made on its device from the initializer, and
  training matches the plain model built from the same seed."""
  _, want = _fit(_mlp())
  distribution = _model_parallel((2, 2), EXAMPLE)
  with distribution.scope(), tfsplit.deferred_init():
    model = _mlp()
  split_model, got = _fit(model, distribution=distribution)
  np.testing.assert_allclose(got["loss"], want["loss"], rtol=1e-5)
  step = split_model.split_step
  assert set(step.deferred) >= {v.path for v in model.variables}
  assert step.manifest["dense/kernel"]["sharding"] == [None, "tp"]


@pytest.mark.slow  # 30 s; the Llama layout above runs the same mapping in CI
def test_a_corpus_model_fits_under_a_gemma_style_layout():
  """The causal LM (EinsumDense attention: [hidden, heads, head_dim]) under
  fit, its weights over both axes."""
  layouts = {
      ".*attn/(query|key|value)/kernel": ("batch", "model", None),
      ".*attn/(query|key|value)/bias": ("model", None),
      ".*attn/attention_output/kernel": ("model", None, "batch"),
      ".*mlp/fc1/kernel": ("batch", "model"),
      ".*mlp/fc2/kernel": ("model", "batch"),
  }
  split_model, _ = check_fit("causallm_keras3",
                             dict(distribution=_model_parallel((2, 2), layouts)))
  manifest = split_model.split_step.manifest
  kernel = next(n for n in manifest if n.endswith("block_0/attn/query/kernel"))
  assert manifest[kernel]["sharding"] == ["dp", "tp", None]


# --- bad input ---------------------------------------------------------------------
def _step(width=32):
  """A tf.function training step over a Keras 3 model's variables (the
  tfsplit.split route: the graph's variable names are their paths)."""
  import tensorflow as tf  # pylint: disable=import-outside-toplevel
  keras.utils.set_random_seed(0)
  model = keras.Sequential([keras.Input((16,)), keras.layers.Dense(width, name="dense"),
                            keras.layers.Dense(4, name="dense_2")], name="mlp")
  optimizer = keras.optimizers.SGD(0.1)
  optimizer.build(model.trainable_variables)

  @tf.function(input_signature=[tf.TensorSpec([BATCH, 16])])
  def step(x):
    with tf.GradientTape() as tape:
      loss = tf.reduce_mean(model(x) ** 2)
    grads = tape.gradient(loss, model.trainable_variables)
    optimizer.apply(grads, model.trainable_variables)
    return loss

  return step


@pytest.mark.parametrize("layouts,shape,width,match", [
    ({".*dense/kernel": (None, "model")}, (1, 4), 30,
     r"^layout \(None, 'model'\) for variable 'mlp/dense/kernel' splits dimension 1 \(size "
     r"30\) over 'model' of size 4, which does not divide it"),
    ({".*dense/kernel": ("model",)}, (1, 2), 32,
     r"^layout \('model',\) for variable 'mlp/dense/kernel' has 1 dimensions, the variable 2"),
    ({".*kernel": (None, "model"), ".*dense/kernel": (None, "model")}, (1, 2), 32,
     r"^Path 'mlp/dense/kernel' matches multiple layout specification keys"),
])
def test_bad_layouts_are_one_line(layouts, shape, width, match):
  # (An axis the mesh lacks is Keras's own error, when the LayoutMap is set.)
  with pytest.raises(PlanError, match=match) as info:
    tfsplit.split(_step(width), distribution=_model_parallel(shape, layouts))
  assert "\n" not in str(info.value)


def test_a_key_that_matches_nothing_is_named(caplog):
  layouts = dict(EXAMPLE, **{".*conv.*kernel": (None, None, None, "model")})
  with caplog.at_level(logging.WARNING):
    tfsplit.split(_step(), distribution=_model_parallel((1, 2), layouts))
  assert any("layout map key '.*conv.*kernel' matches no variable" in r.getMessage()
             for r in caplog.records), [r.getMessage() for r in caplog.records]
  assert any("the layout map splits 4 of 4 variables over tp" in r.getMessage()
             for r in caplog.records)


def test_bad_distributions_are_one_line():
  three = kd.ModelParallel(layout_map=kd.LayoutMap(kd.DeviceMesh(
      (1, 2, 2), ("batch", "model", "seq"), devices=kd.list_devices()[:4])),
                           batch_dim_name="batch")
  fsdp = _model_parallel((2, 2), {".*dense/kernel": ("batch", "model")})
  cases = [
      (lambda: tfsplit.split(_step(), distribution=three),
       r"has 2 model axes of size 2 or more \(model, seq\); tfsplit maps one"),
      (lambda: tfsplit.split(_step(), mesh="tp=2", distribution=fsdp),
       r"mesh 'tp=2' differs from the distribution's device mesh \(batch=2, model=2, that "
       r"is dp=2,tp=2\)"),
      (lambda: tfsplit.split(_step(), distribution=fsdp, zero=1),
       r"the layout map splits weights over 'batch' .* but zero=1 was given"),
      (lambda: tfsplit.split(_step(), distribution="dp=2"),
       r"distribution must be a keras.distribution.ModelParallel or DataParallel, got str"),
      (lambda: tfsplit.keras.split(_tf_keras_model(), distribution=fsdp),
       r"distribution= is Keras 3's keras.distribution API; this is a tf_keras model"),
  ]
  for make, match in cases:
    with pytest.raises(PlanError, match=match) as info:
      make()
    assert "\n" not in str(info.value)


def _tf_keras_model():
  import tf_keras  # pylint: disable=import-outside-toplevel
  return tf_keras.Sequential([tf_keras.layers.Dense(4, input_shape=(16,))])
