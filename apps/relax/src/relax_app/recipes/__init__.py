"""GPU recipes: YAML configs (``apps/relax/recipes/``, shipped in the wheel as ``relax_app/recipes/configs``)
and the converters from public datasets' own files to the jsonl ``relax train`` reads (``relax prepare-data``:
:mod:`relax_app.recipes.loaders`).
"""

from pathlib import Path

from relax_app.recipes.loaders import FORMATS, ConversionError, ConversionReport, convert

__all__ = ["FORMATS", "ConversionError", "ConversionReport", "convert", "recipe_path", "shipped_configs"]


def recipe_path(name: str) -> Path | None:
    """The shipped recipe of file name ``name`` (``qwen3_4b_dapo.yaml``): the wheel's copy, else the source
    tree's (an editable install); None if there is none."""
    here = Path(__file__).resolve().parent
    for folder in (here / "configs", here.parents[2] / "recipes"):
        if (folder / name).is_file():
            return folder / name
    return None


def shipped_configs(argv: list[str]) -> list[str]:
    """``argv`` with each config file named that is not there (``X.yaml``, ``--config=X.yaml``) replaced by
    the shipped recipe of its file name, so a launcher's ``apps/relax/recipes/X.yaml`` runs from any
    directory of an image that installed relax; a file that is there is used as it is."""
    out = list(argv)
    for i, arg in enumerate(out):
        prefix = "--config=" if arg.startswith("--config=") else ""
        name = arg.removeprefix(prefix)
        if name.startswith("-") or not name.endswith((".yaml", ".yml")) or Path(name).exists():
            continue
        if (found := recipe_path(Path(name).name)) is not None:
            out[i] = prefix + str(found)
    return out
