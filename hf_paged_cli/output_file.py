"""The --output file of `hf-paged generate --input`: checked before the model loads, resumed by a rerun, one JSON
line per input line. Standard library only (hf_paged/cli.py imports it at start-up)."""
from __future__ import annotations

import json
import os
from pathlib import Path

from . import CliError


def check_output(output: Path) -> None:
    """--output must name a file in an existing folder: found before the model loads."""
    if output.is_dir():
        raise CliError(f"--output {output} is a folder: name a .jsonl file (such as {output / 'out.jsonl'})")
    if not output.parent.is_dir():
        raise CliError(f"--output {output}: the folder {output.parent} does not exist (create it first)")
    if not os.access(output if output.exists() else output.parent, os.W_OK):
        raise CliError(f"--output {output}: not writable (permission denied)")


def lines_done(output: Path, options: dict) -> set[int]:
    """Input line numbers already in `output` (a rerun skips them). A torn last line (an interrupted write) is cut
    off and a whole last line gets its missing newline, so that appending continues cleanly. Lines written with
    other generation `options` are refused; lines without "options" (older versions) are taken as they are."""
    if not output.exists():
        return set()
    done, keep, last, now = set(), 0, b"\n", json.loads(json.dumps(options))  # `options` as read back
    try:
        with open(output, "rb") as f:
            for raw in f:
                try:
                    record = json.loads(raw)
                    done.add(int(record["input_line"]))
                except (ValueError, KeyError, TypeError):
                    if raw.endswith(b"\n"):
                        raise CliError(f"{output}: a line without input_line is not an hf-paged output; choose "
                                       f"another --output") from None
                    break
                if record.get("options", now) != now:
                    there = record["options"] if isinstance(record["options"], dict) else {}
                    differ = ", ".join(f"--{k.replace('_', '-')} {there.get(k)} there, {v} now"
                                       for k, v in now.items() if there.get(k) != v) or json.dumps(there)
                    raise CliError(f"{output} was written with other generation options ({differ}): rerun with "
                                   f"those to complete it, or write to a new --output file")
                keep, last = keep + len(raw), raw
        if keep < output.stat().st_size or not last.endswith(b"\n"):
            with open(output, "r+b") as f:
                f.truncate(keep)
                f.seek(keep)
                f.write(b"" if last.endswith(b"\n") else b"\n")
    except OSError as e:
        raise CliError(f"cannot resume --output {output}: {e.strerror or e}") from None
    return done


def write_line(sink, job, output, options: dict) -> None:
    """One output line: `job`'s (a cli.Job) completion (a RequestOutput), with the generation `options`."""
    completion = output.outputs[0]
    record = {**job.extra, "prompt": job.text, "text": completion.text, "token_ids": list(completion.token_ids),
              "finish_reason": completion.finish_reason, "input_line": job.line, "options": options}
    if completion.error:
        record["error"] = completion.error
    sink.write(json.dumps(record, ensure_ascii=False) + "\n")
    sink.flush()
