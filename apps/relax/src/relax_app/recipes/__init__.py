"""GPU recipes' data side: converters from public datasets' own files to the jsonl ``relax train`` reads.

The recipes themselves are YAML configs in ``apps/relax/recipes/``; ``relax prepare-data`` runs these
converters (see :mod:`relax_app.recipes.loaders`).
"""

from relax_app.recipes.loaders import FORMATS, ConversionError, ConversionReport, convert

__all__ = ["FORMATS", "ConversionError", "ConversionReport", "convert"]
