"""What every `reamer` command shares: the context (socket, output format), output helpers
(tables, JSON) and the one place where user errors become "error: …\\nfix: …" and an exit code."""
from __future__ import annotations

import dataclasses
import json
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

import click

from reamer.errors import EXIT_BAD_INPUT, EXIT_FAILURE, ErrorKind, ReamerError, exit_code_for_status

DEFAULT_SOCKET = "/run/reamer/reamer.sock"
OUTPUT_FORMATS = ("table", "json")


class BadInput(ReamerError):
    """The user gave a value reamer cannot use (exit code 2)."""

    kind = ErrorKind.BAD_INPUT


@dataclass
class CliContext:
    socket_path: str
    output: str = "table"
    instance: str | None = None  # --instance: which agent of the node (None: the node's one agent)

    @property
    def json(self) -> bool:
        return self.output == "json"

    def client(self):
        """An API client for the agent's socket (imported late: local commands need no HTTP stack)."""
        from reamer.api.client import ApiClient

        return ApiClient(self.socket_path)


pass_cli = click.make_pass_decorator(CliContext)


# ---------------------------------------------------------------------------------------------- output


def to_jsonable(value: Any) -> Any:
    """Dataclasses, pydantic models, paths, sets and tuples as plain JSON values."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: to_jsonable(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if hasattr(value, "model_dump"):
        return to_jsonable(value.model_dump(mode="json"))
    if isinstance(value, dict):
        return {str(k): to_jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple, set, frozenset)):
        items = sorted(value) if isinstance(value, (set, frozenset)) else value
        return [to_jsonable(v) for v in items]
    if isinstance(value, Path):
        return str(value)
    if isinstance(value, float) and value != value:  # NaN is not JSON
        return None
    return value


def print_json(value: Any) -> None:
    click.echo(json.dumps(to_jsonable(value), indent=2, sort_keys=False))


def format_cell(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        if value != value:
            return "-"
        return f"{value:.1f}" if abs(value) >= 10 else f"{value:.2f}"
    if isinstance(value, (list, tuple)):
        return ",".join(format_cell(v) for v in value) or "-"
    return str(value)


def render_table(headers: Sequence[str], rows: Iterable[Sequence[Any]]) -> str:
    """A plain, left-aligned text table; an empty table says so rather than printing only headers."""
    cells = [[format_cell(v) for v in row] for row in rows]
    if not cells:
        return "(none)"
    widths = [len(h) for h in headers]
    for row in cells:
        for i, cell in enumerate(row):
            widths[i] = max(widths[i], len(cell))
    lines = ["  ".join(h.upper().ljust(w) for h, w in zip(headers, widths)).rstrip()]
    for row in cells:
        lines.append("  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip())
    return "\n".join(lines)


def print_table(headers: Sequence[str], rows: Iterable[Sequence[Any]]) -> None:
    click.echo(render_table(headers, rows))


def render_fields(pairs: Iterable[tuple[str, Any]]) -> str:
    """Key: value lines, aligned."""
    pairs = [(k, format_cell(v)) for k, v in pairs]
    if not pairs:
        return ""
    width = max(len(k) for k, _ in pairs)
    return "\n".join(f"{k + ':':<{width + 1}} {v}" for k, v in pairs)


def emit(cli: CliContext, data: Any, render: Callable[[Any], str]) -> None:
    """JSON of `data` with -o json, else the human rendering."""
    if cli.json:
        print_json(data)
    else:
        click.echo(render(data))


def field(obj: Any, name: str, default: Any = None) -> Any:
    """Read `name` from a dict, pydantic model or dataclass alike (API answers come in either shape)."""
    if isinstance(obj, dict):
        return obj.get(name, default)
    return getattr(obj, name, default)


# ---------------------------------------------------------------------------------------------- errors


def exit_code_for(error: BaseException) -> int:
    """The exit status of a command that failed with `error`, from the one table (reamer.errors): the agent's
    answer by the HTTP status it sent (ApiError), an error of this process by its kind."""
    from reamer.api.client import ApiError

    if isinstance(error, ValueError):
        return EXIT_BAD_INPUT
    if isinstance(error, ApiError):
        return exit_code_for_status(error.status)
    if isinstance(error, ReamerError):
        return error.kind.exit_code
    status = getattr(error, "status_code", None) or getattr(error, "status", None)
    if isinstance(status, int):
        return exit_code_for_status(status)
    return EXIT_FAILURE


def error_doc(error: BaseException, exit_code: int) -> dict:
    """A failure as -o json prints it on stdout: {"error": {"message", "fix", "exit_code", ["code", "status"]}}."""
    message, fix = (error.message, error.fix) if isinstance(error, ReamerError) else (str(error), "")
    doc: dict[str, Any] = {"message": message, "fix": fix, "exit_code": exit_code}
    for name in ("code", "status"):  # the agent's answer, when it was one (ApiError)
        value = getattr(error, name, None) if not isinstance(error, ReamerError) or _is_answer(error) else None
        if isinstance(value, (str, int)) and not isinstance(value, bool):
            doc[name] = value
    data = getattr(error, "data", None)
    if isinstance(data, dict) and data:
        doc["data"] = to_jsonable(data)
    return {"error": doc}


def _is_answer(error: ReamerError) -> bool:
    from reamer.api.client import ApiError

    return isinstance(error, ApiError)


def _wants_json() -> bool:
    ctx = click.get_current_context(silent=True)
    obj = ctx.find_object(CliContext) if ctx is not None else None
    return obj is not None and obj.json


def report_error(error: BaseException, code: int | None = None) -> int:
    """Print a user error as "error: …" and "fix: …" lines on stderr (and, with -o json, as a JSON object on
    stdout, so scripts read failures where they read answers); return the exit code."""
    if isinstance(error, ReamerError):
        message, fix = error.message, error.fix
    else:
        message, fix = str(error), ""
    code = exit_code_for(error) if code is None else code
    click.echo(f"error: {message}", err=True)
    if fix:
        click.echo(f"fix: {fix}", err=True)
    if _wants_json():
        print_json(error_doc(error, code))
    return code


class ReamerGroup(click.Group):
    """A click group that turns every ReamerError (and a bad value) into a message and an exit code,
    never a traceback. Unexpected exceptions still print one line; REAMER_DEBUG=1 shows the traceback."""

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except (click.exceptions.Exit, click.exceptions.Abort):
            raise
        except click.ClickException as error:  # a bad flag or value: click prints it; -o json reads it too
            if _wants_json() and not getattr(error, "json_printed", False):  # nested groups: print it once
                error.json_printed = True  # type: ignore[attr-defined]
                print_json({"error": {"message": error.format_message(), "fix": "see `reamer COMMAND --help`",
                                      "exit_code": error.exit_code}})
            raise
        except ReamerError as error:
            ctx.exit(report_error(error))
        except ValueError as error:
            ctx.exit(report_error(BadInput(str(error), "check the value against `reamer COMMAND --help`")))
        except KeyboardInterrupt:
            click.echo("interrupted", err=True)
            ctx.exit(130)
        except Exception as error:  # noqa: BLE001 — the last line of defence for a user-facing tool
            if os.environ.get("REAMER_DEBUG"):
                raise
            if type(error).__module__.startswith("httpx"):  # the agent went away mid-request
                ctx.exit(report_error(ReamerError(
                    f"the connection to the agent failed ({type(error).__name__}: {error})",
                    "check that the agent runs (systemctl status reamer) and read its log (journalctl -u reamer)")))
            ctx.exit(report_error(ReamerError(f"unexpected {type(error).__name__}: {error}",
                                              "rerun with REAMER_DEBUG=1 to see the traceback and report it"),
                                  EXIT_FAILURE))


def checked_instance(name: str) -> str:
    """An agent instance name as --instance takes it (it becomes part of paths and a cgroup name)."""
    import re

    from reamer.agent.config import INSTANCE_PATTERN

    if not re.match(INSTANCE_PATTERN, name):
        raise click.BadParameter(f"{name!r} is not an agent instance name: letters, digits, '_', '.', '-', "
                                 "at most 64, starting with a letter or digit", param_hint="--instance")
    return name


def cpulist_option_value(text: str | None) -> list[int] | None:
    """Parse a --cpus/--reserved-cpus value; a bad list is bad input (exit 2) with the syntax."""
    if text is None:
        return None
    from reamer.host.cpulist import parse_cpulist

    try:
        return parse_cpulist(text)
    except ValueError as error:
        raise BadInput(str(error), 'write CPUs like "0-3,8"') from None



# ---------------------------------------------------------------------------------------------- options


def traffic_options(command: Callable) -> Callable:
    """--shape NAME:DIMS (repeatable) and --input-data FILE: the traffic, in perf_analyzer's convention."""
    command = click.option(
        "--input-data", "input_data", default=None, metavar="FILE",
        help="Sample inputs: a .npz of named arrays, or perf_analyzer's JSON input-data file.")(command)
    return click.option(
        "--shape", "shapes", multiple=True, metavar="NAME:DIMS",
        help="Shape of an input's traffic, as perf_analyzer takes it: e.g. input_ids:1,128 (all dims, the first "
             "being the batch) or input_ids:128 (without the batch dim). Repeatable.")(command)


def sample_spec(shapes: Sequence[str], input_data: str | None):
    """The samples.SampleSpec of --shape/--input-data (BadInput-class errors name the option and the fix)."""
    from reamer.serve.samples import SampleSpec, shapes_from_options

    data = os.path.abspath(input_data) if input_data else None
    if data is not None and not os.path.isfile(data):
        raise BadInput(f"--input-data {input_data} does not exist",
                       "give a .npz of named arrays, or a perf_analyzer JSON input-data file")
    return SampleSpec(shapes=shapes_from_options(shapes), input_data=data)


class BackendChoice(click.Choice):
    """onnxruntime | openvino, also as users write them (ORT, onnx-runtime, OpenVINO, ov)."""

    def __init__(self) -> None:
        from reamer.plan.layout import BACKENDS

        super().__init__(BACKENDS)

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        from reamer.serve.spec import canonical_backend

        return super().convert(canonical_backend(str(value)) or value, param, ctx)


def _set_output(ctx: click.Context, _param: click.Parameter, value: str | None) -> None:
    if value is not None:
        obj = ctx.find_object(CliContext)
        if obj is not None:
            obj.output = value


def add_output_option(group: click.Group) -> None:
    """Let every command take -o FORMAT after its name too (`reamer infer list -o json`), and --output where
    the command has no --output of its own (`infer deploy --output DIR` is the offline output directory)."""
    for command in group.commands.values():
        if isinstance(command, click.Group):
            add_output_option(command)
            continue
        taken = {opt for param in command.params for opt in getattr(param, "opts", [])}
        if "-o" in taken:
            continue
        names = ["-o"] + (["--output"] if "--output" not in taken else [])
        command.params.append(click.Option(
            [*names, "output_format"], type=click.Choice(OUTPUT_FORMATS), default=None, expose_value=False,
            callback=_set_output, show_default=False, help="Output format (also accepted before the command)."))


def wait_for_capacity_change(client: Any, since: int, seconds: float) -> int:
    """Wait up to `seconds` for a `capacity_changed` event after event `since` (long polls of at most 20 s, so a
    dropped connection is noticed); the last event id seen, for the next wait. Used by the capacity reporters."""
    deadline = time.monotonic() + seconds
    while (left := deadline - time.monotonic()) > 0:
        answer = client.events(since=since, wait=min(left, 20.0))
        since = answer.last_id
        if any(e.kind == "capacity_changed" for e in answer.events):
            break
    return since
