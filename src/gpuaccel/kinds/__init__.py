"""The built-in data kinds, one file each, registered on import (``data/kinds.py`` imports this
package on the registry's first lookup). A new kind is a file here with a ``DataKind`` subclass
passed to ``register_kind``, and its line below."""

from . import audio, corpus, images, ratings, scenes, sentences, translation  # noqa: F401  (registers them)
