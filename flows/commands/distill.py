"""``kiln-flows distill self|merge|pump``: Kiln's distillation recipes, one request file each.

    $ kiln-flows distill self  --request self.json  --student ./student --out ./kiln-data
    $ kiln-flows distill merge --request merge.json --student ./student --out ./kiln-data
    $ kiln-flows distill pump  --request pump.json  --student ./student --out ./kiln-data

Each request is the body Kiln's route takes (``DistillSelfRequest``, ``DistillMergeRequest``,
``DistillPumpRequest``), checked with Kiln's submit-time rules before any model loads (exit 2 naming the
field); the recipe then scores its teacher signal and trains through the same engine path as
``kiln-flows train``. One module per recipe (``flows.commands.distill_<recipe>``) adds its options.
"""

from __future__ import annotations

import argparse
import importlib

NAME = "distill"
HELP = "Run one of Kiln's distillation recipes (self, merge, pump) from its request file."

RECIPES = {
    "self": "flows.commands.distill_self",
    "merge": "flows.commands.distill_merge",
    "pump": "flows.commands.distill_pump",
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """One subcommand per recipe module that ships in this build."""
    sub = parser.add_subparsers(dest="distill_recipe", metavar="RECIPE")
    for recipe, module_name in RECIPES.items():
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as error:
            if error.name == module_name:
                continue
            raise
        recipe_parser = sub.add_parser(recipe, help=module.HELP, description=module.HELP)
        module.add_arguments(recipe_parser)
        recipe_parser.set_defaults(_distill_run=module.run)


def run(args: argparse.Namespace) -> int:
    """Dispatch to the chosen recipe; without one, say which exist (exit 2)."""
    import sys

    action = getattr(args, "_distill_run", None)
    if action is None:
        print(f"kiln-flows distill: choose a recipe: {' | '.join(RECIPES)}", file=sys.stderr)
        return 2
    return action(args)
