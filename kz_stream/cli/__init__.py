"""The ``kz`` command line. Errors print one clear line and exit non-zero.

One module per command group; this one builds ``app`` from them, in the order ``kz --help``
lists the commands."""

from __future__ import annotations

import typer

# ``_settings`` and ``_rerun_command``: tests import them from here, as from the one module
# the command line was.
from kz_stream.cli._common import _settings as _settings
from kz_stream.cli._dataset import dataset_app, rescore_cmd
from kz_stream.cli._dlq import dlq_app
from kz_stream.cli._eval import eval_app
from kz_stream.cli._infra import infra_app
from kz_stream.cli._run import _rerun_command as _rerun_command
from kz_stream.cli._run import run_loop, serve, train
from kz_stream.cli._store import audit, db_app, frontier, replay, tail
from kz_stream.cli._verify import verify_app
from kz_stream.cli._warmstart import warmstart_app

__all__ = ["app", "main"]

app = typer.Typer(
    name="kz",
    help="kz_stream: train LLMs to write fast, correct GPU kernels.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
)
app.command()(serve)
app.command()(replay)
app.command()(audit)
app.command()(tail)
app.command()(frontier)
app.command()(train)
app.command("run")(run_loop)
app.command("rescore")(rescore_cmd)
app.add_typer(infra_app, name="infra")
app.add_typer(db_app, name="db")
app.add_typer(dlq_app, name="dlq")
app.add_typer(eval_app, name="eval")
app.add_typer(dataset_app, name="dataset")
app.add_typer(warmstart_app, name="warmstart")
app.add_typer(verify_app, name="verify")


def main() -> None:
    app()
