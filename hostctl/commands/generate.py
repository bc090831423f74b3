"""`ringleader generate`: stream one completion from a running server, or with --chat and no
prompt, a conversation on stdin (one user turn per line).  The sampling options are one per
sampling field, named, explained, defaulted and judged by its declaration
(ringleader.ipc.sampling_params).  --json-schema, --regex, --choice and --json-object constrain
the output (protocol 1.8's `structured`, enforced on the device)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from typing import Any, TextIO

from ringleader.hostctl.commands.cannot_start import CommandError
from ringleader.hostctl.commands.client_options import add_client_options, client_from_args, no_answer
from ringleader.ipc.client.core import ERR_DISCONNECTED
from ringleader.ipc.protocol import Limits
from ringleader.ipc.sampling_params import FIELDS, SamplingError, SamplingField, SamplingParams
from ringleader.ipc.structured import StructuredError, StructuredSpec, structured_from_wire


def int_list(text: str) -> list[int]:
    """An argparse type: comma-separated integers."""
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


# the ranges the server's decoder takes (ringleader.ipc.protocol.Limits, docs/protocol.md)
_LIMITS = Limits()


def int_in(low: int, high: int) -> Callable[[str], int]:
    """An argparse type: an integer in [low, high] (a usage error naming the option otherwise)."""

    def value_of(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"expected an integer in [{low}, {high}], got {text!r}"
            ) from None
        if not low <= value <= high:
            shown = text if len(text) <= 24 else text[:20] + "..."
            raise argparse.ArgumentTypeError(f"must be an integer in [{low}, {high}], got {shown}")
        return value

    return value_of


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = subparsers.add_parser("generate", help="stream one completion from a running server")
    p.add_argument("prompt", nargs="?", help="the prompt text (with --chat: the user's turn)")
    p.add_argument("--prompt-ids", type=int_list, help="the prompt as comma-separated token ids")
    p.add_argument(
        "--chat",
        action="store_true",
        help="send chat messages, rendered by the model's chat template; without a prompt, "
        "a conversation with one user turn per line of stdin",
    )
    p.add_argument("--system", help="with --chat: a system turn first")
    add_sampling_options(p)
    add_structured_options(p)
    p.add_argument(
        "--priority",
        type=int_in(_LIMITS.min_priority, _LIMITS.max_priority),
        default=0,
        help=f"in [{_LIMITS.min_priority}, {_LIMITS.max_priority}]; higher goes first among this "
        "client's requests, and on the device under serve --policy priority",
    )
    p.add_argument("--ids", action="store_true", help="print token ids even when text is available")
    p.add_argument(
        "--timeout-ms",
        type=int_in(1, _LIMITS.max_timeout_ms),
        default=None,
        metavar="MS",
        help=f"the server ends the request with error code timeout after this long (1..{_LIMITS.max_timeout_ms}: "
        "a day at most)",
    )
    add_client_options(p, timeout=120.0)
    p.set_defaults(run=run)
    return p


def add_sampling_options(p: argparse.ArgumentParser) -> None:
    """One option per sampling field (--top-p for top_p), with its declaration's help and
    default; a value the declaration refuses is a usage error naming the option (exit code 2)."""
    for spec in FIELDS:
        option = "--" + spec.name.replace("_", "-")
        if spec.kind == "bool":
            p.add_argument(option, action="store_true", default=spec.default, help=spec.help)
        else:
            metavar = "ID[,ID...]" if spec.kind == "token_ids" else None
            p.add_argument(option, type=_checked(spec), default=spec.default, metavar=metavar, help=spec.help)


# how an option's text becomes the value its declaration judges, by the field's kind, and what
# the text must look like
_PARSE_AS: dict[str, tuple[Callable[[str], Any], str]] = {
    "float": (float, "a number"),
    "int": (int, "an integer"),
    "optional_int": (int, "an integer"),
    "token_ids": (int_list, "comma-separated token ids"),
}


def _checked(spec: SamplingField) -> Callable[[str], Any]:
    """An argparse type: the option's text parsed by its kind, then judged by the declaration
    (argparse turns ArgumentTypeError into a usage error naming the option)."""
    parse, looks_like = _PARSE_AS[spec.kind]

    def value_of(text: str) -> Any:
        try:
            return spec.check(parse(text))
        except SamplingError as err:
            raise argparse.ArgumentTypeError(err.reason) from None
        except ValueError:  # not a number at all
            raise argparse.ArgumentTypeError(f"expected {looks_like}, got {text!r}") from None

    return value_of


def add_structured_options(p: argparse.ArgumentParser) -> None:
    """The output's constraint: at most one of --json-schema, --regex, --choice (repeated) and
    --json-object (argparse refuses two, exit code 2)."""
    group = p.add_mutually_exclusive_group()
    group.add_argument(
        "--json-schema", metavar="FILE", help="the output follows the JSON schema in FILE (-: read stdin)"
    )
    group.add_argument("--regex", metavar="PATTERN", help="the whole output matches this regular expression")
    group.add_argument(
        "--choice",
        action="append",
        metavar="TEXT",
        help="the output is exactly one of these texts (repeat the option: --choice yes --choice no)",
    )
    group.add_argument("--json-object", action="store_true", help="the output is a JSON object")


def structured_from_args(args: argparse.Namespace, stdin: TextIO | None = None) -> StructuredSpec | None:
    """The constraint the options ask for, judged as the server judges it; a ValueError with a
    one-line message naming the option when the schema file cannot be read or a value is refused."""
    if args.json_schema is not None:
        option = f"--json-schema {args.json_schema}"
        try:
            if args.json_schema == "-":
                text = (stdin or sys.stdin).read()
            else:
                with open(args.json_schema, encoding="utf-8") as f:
                    text = f.read()
        except (OSError, UnicodeDecodeError) as exc:
            raise ValueError(f"{option}: cannot read it: {exc}") from None
        wire: dict[str, Any] = {"json": text}
    elif args.regex is not None:
        option, wire = "--regex", {"regex": args.regex}
    elif args.choice is not None:
        option, wire = "--choice", {"choice": args.choice}
    elif args.json_object:
        option, wire = "--json-object", {"json_object": True}
    else:
        return None
    try:
        return structured_from_wire(wire)
    except StructuredError as err:
        raise ValueError(f"{option}: {err.reason}") from None


def sampling_from_args(args: argparse.Namespace) -> SamplingParams:
    """The options' values, each judged already by its type."""
    return SamplingParams(**{spec.name: getattr(args, spec.name) for spec in FIELDS})


def run(args: argparse.Namespace) -> int:
    if args.chat:
        if args.prompt_ids is not None:
            print("--chat takes text (a user turn), not --prompt-ids", file=sys.stderr)
            return 2
    elif (args.prompt is None) == (args.prompt_ids is None):
        print("give a prompt or --prompt-ids (one of them)", file=sys.stderr)
        return 2
    if args.json_schema == "-" and args.chat and args.prompt is None:
        print(
            "--json-schema -: stdin holds the conversation (--chat without a prompt); give a file",
            file=sys.stderr,
        )
        return 2
    try:
        structured = structured_from_args(args)
    except ValueError as err:
        print(err, file=sys.stderr)
        return 2
    with client_from_args(args) as client:
        if not args.chat:
            return _print_stream(
                client, args, prompt=args.prompt, prompt_ids=args.prompt_ids, structured=structured
            )[0]
        turns = [{"role": "system", "content": args.system}] if args.system else []
        if args.prompt is not None:  # one question, one answer
            messages = turns + [{"role": "user", "content": args.prompt}]
            return _print_stream(client, args, messages=messages, structured=structured)[0]
        return _chat_loop(client, args, turns, structured)


def _chat_loop(
    client, args: argparse.Namespace, turns: list[dict[str, str]], structured: StructuredSpec | None
) -> int:
    """A conversation on stdin: each line is a user turn; the answers join the history."""
    interactive = sys.stdin.isatty()
    while True:
        if interactive:
            print("> ", end="", flush=True)
        line = sys.stdin.readline()
        if not line:
            return 0
        if not line.strip():
            continue
        turns.append({"role": "user", "content": line.rstrip("\n")})
        rc, answer = _print_stream(client, args, messages=turns, structured=structured)
        if rc:
            return rc
        turns.append({"role": "assistant", "content": answer})


def _print_stream(client, args: argparse.Namespace, **inputs) -> tuple[int, str]:
    """Streams one request to stdout, its end to stderr; (exit code, the text streamed)."""
    stream = client.generate(
        **inputs, sampling=sampling_from_args(args), priority=args.priority, timeout_ms=args.timeout_ms
    )
    show_ids = inputs.get("prompt_ids") is not None or args.ids
    several = args.n > 1  # the choices are printed one after another once they all ended
    text: list[str] = []
    try:
        for chunk in _chunks(stream, args):
            if several:
                continue
            if show_ids or chunk.text is None:
                if chunk.token_ids:
                    print(" ".join(map(str, chunk.token_ids)), end=" ", flush=True)
            else:
                text.append(chunk.text)
                print(chunk.text, end="", flush=True)
    except KeyboardInterrupt:  # Ctrl-C: end the request on the server too, then exit 130
        stream.abort()
        stream.wait(timeout=5)
        interrupted = True
    else:
        interrupted = False
    done = stream.done
    if (
        done is not None
        and done.error_code == ERR_DISCONNECTED
        and (done.error_message or "").startswith("no connection")
    ):
        raise no_answer(args, ConnectionError(done.error_message))  # no server there: one line, exit 1
    if several:
        for choice in stream.choices:
            print(f"--- choice {choice.index} [{choice.finish_reason}]")
            shown = choice.text if choice.text is not None and not show_ids else None
            print(shown if shown is not None else " ".join(map(str, choice.token_ids)))
            _print_logprobs(choice)
        text = [stream.text or ""]
    else:
        print()
        _print_logprobs(stream.choice(0))
    if done is None:  # interrupted, and the server did not confirm the abort in time
        print("[interrupted]", file=sys.stderr)
        return 130, "".join(text)
    print(
        f"[{done.finish_reason}: {done.prompt_tokens} prompt + {done.completion_tokens} "
        f"completion tokens]" + (f" {done.error_code}: {done.error_message}" if done.error_code else ""),
        file=sys.stderr,
    )
    if interrupted:
        return 130, "".join(text)
    return (0 if done.finish_reason != "error" else 1), "".join(text)


def _chunks(stream, args: argparse.Namespace):
    """The stream's chunks; a server that sends nothing for --timeout is a CommandError (exit 1)."""
    while True:
        try:
            yield next(stream)
        except StopIteration:
            return
        except TimeoutError:
            what = "nothing more" if any(c.token_ids for c in stream.choices) else "nothing"
            stream.close()  # aborts the request, should the server be there after all
            raise CommandError(
                f"the server at {args.connect} sent {what} within {args.timeout:g} s (--timeout)", 1
            ) from None


def _print_logprobs(choice) -> None:
    """A request with --logprobs: one line per generated token, its logprob and its top
    alternatives with theirs."""
    if choice.logprobs is None:
        return
    for token_id, entry in zip(choice.token_ids, choice.logprobs):
        name = repr(entry.token) if entry.token is not None else str(token_id)
        names = [repr(t) for t in entry.top_tokens] if entry.top_tokens else [str(i) for i in entry.top_ids]
        top = ", ".join(f"{n} {lp:.4f}" for n, lp in zip(names, entry.top_logprobs))
        print(f"{name:>20} {entry.logprob:9.4f}" + (f"  | {top}" if top else ""))
