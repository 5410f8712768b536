"""Models: a registry of CNNs, a detector and a segmenter, a GPT, sentence and audio classifiers, rating predictors, a translator (``create_model``), plus user and timm models."""

from . import audio, dense, dlrm, fastnet, gpt, mobilenet, recsys, resnet, seq2seq, simple, text  # noqa: F401  (registers the built-in models)
from .registry import create_model, list_models, register_model

__all__ = ["create_model", "list_models", "register_model"]
