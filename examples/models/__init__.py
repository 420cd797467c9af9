"""Example model zoo: the same MLP and GPT in raw TF, Keras 3 and tf_keras.

    import models            # examples/ on sys.path (tests and tools/ put it there)
    ex = models.build("gpt_keras3", size="tiny", seed=0)
    loss = ex.train_step(*ex.make_inputs("train", seed=1))
    graph_fn = ex.concrete("train")   # ConcreteFunction, static shapes

Names are `<family>_<flavor>` with family in {mlp, gpt} and flavor in {raw,
keras3, tfkeras}; sizes are tiny (tests), small (demos) and large (48-block
GPT for benchmarking graph passes). Weights come from `seed` only.

The corpus (corpus.py; CORPUS_NAMES, not in NAMES) adds Keras-only families
causallm, llama, bert and vit as `<family>_{keras3,tfkeras}`, sizes tiny and
small, built the same way: models.build("llama_keras3", size="tiny").
"""
import time

from absl import logging

from .example import (CONFIGS, CORPUS_NAMES, FLAVORS, KINDS, NAMES, SIZES,
                      ExampleModel, GptConfig, MlpConfig)


def config_of(name, size="tiny"):
  """The config build(name, size) uses (its batch, widths...), without
  building the model."""
  from . import example  # pylint: disable=import-outside-toplevel
  family, _ = example.split_name(name)
  if family in example.CORPUS_FAMILIES:
    from . import corpus  # pylint: disable=import-outside-toplevel
    return corpus.config_for(family, size)
  return example.config_for(family, size)


def build(name, size="tiny", seed=0, batch_size=None, precision=None, **config):
  """Builds example `name` at `size`; returns an ExampleModel.

  batch_size overrides the size's default (static) batch size; `config`
  overrides other fields of the size's config (hidden=512, blocks=2, ...;
  of the corpus models only the MoE decoders' experts=8). precision (corpus models only):
  'mixed_bfloat16' or 'mixed_float16' (corpus.PRECISIONS).
  """
  from . import example  # pylint: disable=import-outside-toplevel
  family, flavor = example.split_name(name)
  start = time.time()
  if family in example.CORPUS_FAMILIES:
    experts = config.pop("experts", None)
    if config:
      raise TypeError(f"{name}: the corpus models take no config overrides but experts=")
    from . import corpus  # pylint: disable=import-outside-toplevel
    ex = corpus.build(name, size, seed, batch_size, precision, experts)
  elif precision is not None:
    raise TypeError(f"{name}: precision is for the corpus models")
  elif flavor == "raw":
    cfg = example.config_for(family, size, batch_size, overrides=config)
    from . import raw  # pylint: disable=import-outside-toplevel
    ex = raw.build(family, name, size, cfg, seed)
  else:
    cfg = example.config_for(family, size, batch_size, overrides=config)
    from . import keras_models  # pylint: disable=import-outside-toplevel
    if flavor == "keras3":
      import keras as K
    else:
      import tf_keras as K
    ex = keras_models.build(K, name, size, cfg, seed)
  logging.info("built example %s (%s, seed %d) in %.1fs", name, size, seed,
               time.time() - start)
  return ex


__all__ = ["CONFIGS", "CORPUS_NAMES", "FLAVORS", "KINDS", "NAMES", "SIZES",
           "ExampleModel", "GptConfig", "MlpConfig", "build"]
