"""The ``relax`` command line.

Exit codes: 0 success, 1 the run failed at run time, 2 the spec or the command line is invalid, 130
the run was stopped by Ctrl-C or SIGTERM (its last checkpoint is kept for ``--resume``).
User errors print a message, never a traceback. ``validate``, ``plan``, ``schema`` and ``plugins``
import neither torch nor ray; ``run`` imports the runtime only after the spec is valid.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
from pathlib import Path
from typing import Any

from relax import __version__
from relax.errors import SpecError

EXIT_OK, EXIT_RUN_FAILED, EXIT_INVALID, EXIT_INTERRUPTED = 0, 1, 2, 130


class UsageError(Exception):
    """A command-line mistake (exit 2)."""


def _load(spec_ref: str, overrides: list[str], *, runnable: bool = False, here: bool = True):
    """The validated spec and its folder; ``runnable`` adds the checks ``relax run`` makes before it
    starts anything (today's runtime and, with ``here``, this machine's GPUs)."""
    from relax.config import load_spec
    from relax.config.redaction import attach, scrubbed_error
    from relax.spec import validate_spec

    loaded = load_spec(spec_ref, overrides)
    try:
        spec = validate_spec(loaded.raw, base_dir=loaded.base_dir, runnable=runnable, here=here)
    except SpecError as exc:  # a message may quote a value taken from the environment
        raise scrubbed_error(exc, loaded.redactions) from None
    return attach(spec, loaded.redactions), loaded.base_dir


def cmd_validate(args: argparse.Namespace) -> int:
    """The spec judged as a spec (exit 2 on a problem); what this machine lacks to run it is a note,
    an error with ``--here`` (as ``relax run`` makes it)."""
    spec, base_dir = _load(args.spec, args.overrides, runnable=True, here=args.here)
    from relax.plan import make_plan
    from relax.spec.rules import gpus_requested
    from relax.spec.validate import machine_notes

    make_plan(spec, base_dir=base_dir)  # `relax run` plans before it starts: a layout or memory problem is the spec's

    gpus = gpus_requested(spec)
    where = f"{gpus} GPU{'s' if gpus != 1 else ''}" if gpus else "CPU"
    print(f"ok: {spec.name} is valid ({spec.algorithm.name}, {spec.placement.mode} mode, "
          f"max_staleness {spec.async_policy.max_staleness}, {where})")
    for note in [] if args.here else machine_notes(spec, base_dir=base_dir):
        print(f"note (this machine, not the spec; `relax run` and `relax validate --here` refuse it here): {note}")
    return EXIT_OK


def cmd_plan(args: argparse.Namespace) -> int:
    spec, base_dir = _load(args.spec, args.overrides)
    from relax.config.redaction import redactions_of
    from relax.plan import make_plan, render

    plan = make_plan(spec, base_dir=base_dir)
    print(render(plan, args.format, redactions_of(spec)), end="")
    return EXIT_OK


def cmd_config(args: argparse.Namespace) -> int:
    """The spec as the run sees it: extends merged, overrides applied, every default filled; a
    self-contained file (no ``extends``) that ``relax run`` accepts as it is. Values taken from
    the environment are printed as their ``${oc.env:...}`` expressions, and credentials named as
    such as ``<redacted>`` (``relax.config.redaction``), as in a run's ``spec.yaml``."""
    import yaml

    from relax.config.redaction import spec_view

    spec, _ = _load(args.spec, args.overrides)
    print(f"# {args.spec}{''.join(' ' + o for o in args.overrides)}: resolved by relax {__version__}")
    shown = {key: value for key, value in spec_view(spec).items() if key != "extends"}  # no secret in the clear
    print(yaml.safe_dump(shown, sort_keys=False, allow_unicode=True), end="")
    return EXIT_OK


def cmd_run(args: argparse.Namespace) -> int:
    # A spec that means nothing exits 2 here; one this runtime or machine cannot run exits 1 from
    # run_spec's preflight, which makes the same checks as `relax validate`.
    spec, base_dir = _load(args.spec, args.overrides)
    from relax.plan import make_plan

    plan = make_plan(spec, base_dir=base_dir)
    from relax.runtime.driver.launch import run_spec  # heavy imports start here

    return run_spec(spec, plan, base_dir=base_dir, resume=args.resume)


def cmd_report(args: argparse.Namespace) -> int:
    from relax.runtime.driver.report import eval_rows, eval_table, write_report

    run_dir = Path(args.run_dir)
    try:
        path = write_report(run_dir, Path(args.output) if args.output else None)
    except (FileNotFoundError, ValueError) as exc:
        raise UsageError(str(exc)) from None
    evals = eval_rows(run_dir)
    if evals:
        print(f"held-out evaluation ({run_dir / 'eval.jsonl'}):")
        print(eval_table(evals))
    print(f"wrote {path}")
    return EXIT_OK


def cmd_samples(args: argparse.Namespace) -> int:
    from relax.runtime.samples import SamplesError, format_sample, read_samples, worst_rows

    try:
        rows = read_samples(Path(args.run_dir))
    except SamplesError as exc:
        raise UsageError(str(exc)) from None
    if args.step is not None:
        steps = sorted({row["step"] for row in rows})
        rows = [row for row in rows if row["step"] == args.step]
        if not rows:
            raise UsageError(f"the run has no samples of step {args.step}; its sampled steps are "
                             f"{', '.join(map(str, steps)) or 'none'}")
    if args.worst is not None:
        if args.worst < 1:
            raise UsageError(f"--worst {args.worst}: give how many rows to show, 1 or more")
        rows = worst_rows(rows, args.worst)
    if not rows:
        raise UsageError(f"{Path(args.run_dir) / 'samples.jsonl'} holds no samples yet (the run has not reached "
                         "its first sampled step); wait for it, or look at another run")
    print("\n\n".join(format_sample(row) for row in rows))
    return EXIT_OK


def cmd_trace(args: argparse.Namespace) -> int:
    from relax.telemetry.analysis import load_spans, render_summary, summarize_traces, to_chrome_trace

    try:
        spans = load_spans(Path(args.run_dir))
    except (FileNotFoundError, ValueError) as exc:
        raise UsageError(str(exc)) from None
    print(render_summary(summarize_traces(spans)), end="")
    if args.chrome:
        Path(args.chrome).write_text(json.dumps(to_chrome_trace(spans)))
        print(f"wrote {args.chrome} (open it in https://ui.perfetto.dev or chrome://tracing)")
    return EXIT_OK


def cmd_scale(args: argparse.Namespace) -> int:
    from relax.runtime.driver.control import ControlError, control_call, parse_scale

    run_dir = Path(args.run_dir)
    try:
        request = parse_scale(args.changes) if args.changes else None
    except ControlError as exc:
        raise UsageError(str(exc)) from None
    try:
        if request is None:
            status = control_call(run_dir, "GET", "/status", timeout_s=30)
            print(json.dumps(status, indent=2))
            return EXIT_OK
        result = control_call(run_dir, "POST", "/scale", request)
    except ControlError as exc:
        print(f"relax scale: {exc}", file=sys.stderr)
        return EXIT_RUN_FAILED
    change = result["rollout"]
    print(f"rollout replicas: {change['before']} -> {change['after']}")
    for replica in result["replicas"]:
        state = " (draining)" if replica["draining"] else ""
        print(f"  {replica['holder']}  node {str(replica['node'])[:12]}{state}")
    return EXIT_OK


def cmd_schema(args: argparse.Namespace) -> int:
    from relax.spec.schema import schema_text, spec_reference_markdown

    if args.write:
        root = Path(args.root)
        (root / "schemas").mkdir(parents=True, exist_ok=True)
        (root / "docs").mkdir(parents=True, exist_ok=True)
        (root / "schemas" / "run-spec.schema.json").write_text(schema_text())
        (root / "docs" / "spec-reference.md").write_text(spec_reference_markdown())
        from relax.plan.model import Plan

        (root / "schemas" / "plan.schema.json").write_text(json.dumps(Plan.model_json_schema(), indent=2) + "\n")
        print(f"wrote schemas/run-spec.schema.json, schemas/plan.schema.json and docs/spec-reference.md under {root}")
    else:
        print(schema_text(), end="")
    return EXIT_OK


def _singular(word: str) -> str:
    """``rewards`` -> ``reward``, ``losses`` -> ``loss``, ``modalities`` -> ``modality``: the form
    both spellings of a kind share."""
    word = word.strip().lower()
    if word.endswith("ies"):
        return word[:-3] + "y"
    if word.endswith("sses"):
        return word[:-2]
    if word.endswith("s") and not word.endswith("ss"):
        return word[:-1]
    return word


def plugin_kind(text: str) -> str:
    """The plugin kind ``text`` names, singular or plural (``reward`` and ``rewards`` are both
    ``rewards``); ``UsageError`` listing the kinds for any other word, since a filter that matches
    nothing would print nothing and look like "no plugins installed"."""
    from relax.contracts import PluginKind

    for kind in PluginKind:
        if _singular(text) == _singular(kind.value):
            return kind.value
    raise UsageError(f"--kind {text!r} is not a plugin kind; choose one of: "
                     + ", ".join(kind.value for kind in PluginKind))


def _type_name(annotation: Any) -> str:
    """A plugin option's type as a user writes it: ``int``, ``list[str]``, ``float | None``."""
    if isinstance(annotation, type) and not getattr(annotation, "__args__", None):
        return annotation.__name__
    return str(annotation).replace("typing.", "").replace("NoneType", "None")


def option_rows(config: Any) -> dict[str, dict[str, Any]]:
    """Each option of a plugin's pydantic ``Config``: its type, its default (absent when the option
    is required) and the first paragraph of its help, for ``relax plugins``."""
    from pydantic_core import PydanticUndefined

    from relax.spec.attribute_docs import document

    options = {}
    for key, field in document(config).model_fields.items():
        row: dict[str, Any] = {"type": _type_name(field.annotation), "required": field.is_required()}
        if not field.is_required():
            default = field.get_default(call_default_factory=True) if field.default is PydanticUndefined \
                else field.default
            row["default"] = default.value if hasattr(default, "value") and not isinstance(default, type) \
                else default
        row["help"] = " ".join((field.description or "").strip().split("\n\n")[0].split())
        options[key] = row
    return options


def _plugin_rows(kind_filter: str | None) -> list[dict[str, Any]]:
    from relax.contracts import PluginKind
    from relax.registry import PluginError, get_registry

    registry = get_registry()
    rows = []
    for kind in PluginKind:
        if kind_filter and kind.value != kind_filter:
            continue
        for name, entry in sorted(registry.entries(kind).items()):
            row: dict[str, Any] = {"kind": kind.value, "name": name, "target": entry.target,
                                   "distribution": entry.distribution, "version": entry.version}
            try:
                cls = registry.load(kind, name)
                row["options"] = option_rows(cls.Config)
                row["status"] = "ok"
            except PluginError as exc:
                row["options"], row["status"] = {}, f"error: {exc}"
            rows.append(row)
    return rows


def _option_line(key: str, option: dict[str, Any]) -> str:
    """``key (type, default 0.5): help`` or ``key (type, required): help``."""
    if option["required"]:
        how = "required"
    else:
        how = f"default {json.dumps(option['default'], default=str)}"
    return f"{key} ({option['type']}, {how}): {option['help']}"


def cmd_plugins(args: argparse.Namespace) -> int:
    kind = plugin_kind(args.kind) if args.kind else None
    rows = _plugin_rows(kind)
    if args.json:
        print(json.dumps(rows, indent=2, default=str))
        return EXIT_OK
    if not rows:
        print(f"no {kind or ''} plugins installed".replace("  ", " "))
        return EXIT_OK
    current = None
    for row in rows:
        if row["kind"] != current:
            current = row["kind"]
            print(f"{current}:")
        status = "" if row["status"] == "ok" else f"  [{row['status']}]"
        print(f"  {row['name']:<22} {row['distribution']} {row['version']}  ({row['target']}){status}")
        for key, option in row["options"].items():
            print(f"      {_option_line(key, option)}")
    return EXIT_OK


#: The shells ``relax completion`` writes a script for (argcomplete's own shell code).
COMPLETION_SHELLS = ("bash", "zsh", "fish")


def cmd_completion(args: argparse.Namespace) -> int:
    """Print the shell code that completes ``relax`` commands, options and files: argcomplete's,
    which calls ``relax`` back with ``_ARGCOMPLETE`` set (see ``complete_if_asked``)."""
    from argcomplete import shellcode

    print(shellcode(["relax"], shell=args.shell), end="")
    return EXIT_OK


def complete_if_asked(parser: argparse.ArgumentParser) -> None:
    """Answer a shell's completion request and exit (argcomplete), when the shell asks: only then is
    argcomplete imported, so ordinary commands pay nothing for completion."""
    import os

    if "_ARGCOMPLETE" in os.environ:
        import argcomplete

        argcomplete.autocomplete(parser)


def add_completion_command(sub: Any) -> None:
    completion = sub.add_parser(
        "completion", help="print the shell code that completes relax commands (bash, zsh, fish)",
        description="Print the shell code that completes relax's commands and options. Load it from your shell's "
                    "start-up file, e.g. `eval \"$(relax completion bash)\"` in ~/.bashrc or "
                    "`eval \"$(relax completion zsh)\"` in ~/.zshrc.")
    completion.add_argument("shell", choices=COMPLETION_SHELLS)
    completion.set_defaults(func=cmd_completion)


#: Exit status of a command whose reader went away (``relax plugins | head``): the shell's own for
#: a process ended by SIGPIPE (128 + 13).
EXIT_BROKEN_PIPE = 141


def quiet_broken_pipe() -> int:
    """The reader of stdout closed it (``| head``): stop writing, without a traceback. Python would
    try to flush stdout again at exit and fail the same way, so stdout is pointed at /dev/null."""
    import os

    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):  # no real file descriptor (a captured stream): nothing to redirect
        pass
    return EXIT_BROKEN_PIPE


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="relax", description="Asynchronous RL post-training engine.")
    parser.add_argument("--version", action="version", version=f"relax {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def spec_command(name: str, help_text: str, func) -> argparse.ArgumentParser:
        p = sub.add_parser(name, help=help_text, description=help_text)
        p.add_argument("spec", help="a YAML/JSON run spec, or a preset name (e.g. tiny-cpu)")
        p.add_argument("overrides", nargs="*", help="overrides in Hydra's grammar: key=value, +key=value (add), "
                       "~key (delete), key=null; e.g. algorithm.kl_coef=0.01")
        p.set_defaults(func=func)
        return p

    validate = spec_command("validate", "check a run spec and report every problem", cmd_validate)
    validate.add_argument("--here", action="store_true",
                          help="also refuse (exit 2) what this machine lacks to run it, as `relax run` does; "
                          "without it, that is printed as a note")
    plan = spec_command("plan", "show where every role runs and its memory, without starting anything", cmd_plan)
    plan.add_argument("--format", choices=["table", "json", "dot", "mermaid"], default="table")
    spec_command("config", "print the resolved spec (extends merged, overrides applied, every default filled)",
                 cmd_config)
    run = spec_command("run", "train", cmd_run)
    run.add_argument("--resume", action="store_true", help="continue from the last checkpoint")

    report = sub.add_parser("report", help="plot reward and step time of a run to a PNG")
    report.add_argument("run_dir", help="the run's output_dir (holds metrics.jsonl)")
    report.add_argument("--output", help="PNG path (default RUN_DIR/report.png)")
    report.set_defaults(func=cmd_report)

    samples = sub.add_parser("samples", help="print what a run's model generated (its samples.jsonl)",
                             description="Print the samples a run kept (trainer.log_samples_every): prompt, "
                                         "response, label and rewards of a few rows of every sampled step.")
    samples.add_argument("run_dir", help="the run's output_dir (holds samples.jsonl)")
    samples.add_argument("--step", type=int, help="only the samples of this step")
    samples.add_argument("--worst", type=int, metavar="K", help="only the K samples with the lowest reward")
    samples.set_defaults(func=cmd_samples)

    trace = sub.add_parser("trace", help="per-role busy/idle time and rollout/train overlap of a run's traces")
    trace.add_argument("run_dir", help="the run's output_dir (holds traces.jsonl), or the traces file")
    trace.add_argument("--chrome", metavar="OUT.json", help="also write a Chrome/Perfetto timeline")
    trace.set_defaults(func=cmd_trace)

    scale = sub.add_parser("scale", help="add or remove rollout replicas of a running elastic run",
                           description="Add or remove rollout replicas of a running run (roles.rollout.max_replicas "
                                       "bounds them); without ROLE=N, print the run's replicas and counters.")
    scale.add_argument("run_dir", help="the running run's output_dir (holds control.json while it runs)")
    scale.add_argument("changes", nargs="*", metavar="ROLE=N", help="e.g. rollout=2")
    scale.set_defaults(func=cmd_scale)

    schema = sub.add_parser("schema", help="print the JSON Schema of the run spec")
    schema.add_argument("--write", action="store_true",
                        help="write schemas/run-spec.schema.json, schemas/plan.schema.json and "
                             "docs/spec-reference.md under --root")
    schema.add_argument("--root", default=".", help="project root for --write")
    schema.set_defaults(func=cmd_schema)

    plugins = sub.add_parser("plugins", help="list installed plugins by kind, with their options")
    plugins.add_argument("--kind", help="only this kind, singular or plural (rollout, trainer, reward(s), ...)")
    plugins.add_argument("--json", action="store_true")
    plugins.set_defaults(func=cmd_plugins)
    add_completion_command(sub)
    return parser


def _command_line(args: argparse.Namespace) -> list[str] | None:
    """The spec command as typed (``relax run tiny-cpu a=b``), to which a fix's overrides are
    added; None for a command that takes no spec."""
    spec = getattr(args, "spec", None)
    if spec is None:
        return None
    return ["relax", args.command, spec, *args.overrides]


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    complete_if_asked(parser)
    args = parser.parse_args(argv)
    try:
        code = args.func(args)
        sys.stdout.flush()  # a closed pipe shows here, inside the handler, not at interpreter exit
        if argv is None:  # the command line itself: the process exits next
            # The interpreter's last garbage collections walk every object that torch, Ray and the
            # libraries made, seconds after a run has written everything; frozen objects are skipped.
            gc.freeze()
        return code
    except SpecError as exc:
        print(exc.render(_command_line(args)), file=sys.stderr)
        return EXIT_INVALID
    except UsageError as exc:
        print(f"relax: {exc}", file=sys.stderr)
        return EXIT_INVALID
    except BrokenPipeError:
        return quiet_broken_pipe()
    except KeyboardInterrupt:  # outside a run's own handling (which says how to resume)
        print("relax: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED


if __name__ == "__main__":
    sys.exit(main())
