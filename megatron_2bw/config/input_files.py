"""The one owner of reading a user's input file inside a one-line error: every file the commands
take (tokenizer files, JSON configs, corpora, HuggingFace directories) is read through here, so
binary, truncated, wrong-typed or wrong-encoded input is "FILE: what is wrong; what to do", never
a UnicodeDecodeError or a TypeError from deep inside a parser.

    read_bytes(path, fix)             the bytes (a directory, a missing or unreadable file: one
                                      line)
    read_text(path, fix)              UTF-8 text (a UTF-8 byte-order mark is dropped); binary data,
                                      UTF-16 and other encodings are named (the byte and its line)
    decode_problem(data)              (why bytes are not UTF-8 text, the advice) or None
    read_json(path, fix, expect=dict) a JSON document of the expected type (dict, list); a file cut
                                      short is named as such
    json_kind(value)                  "a JSON list", "a string", ... (for the callers' type checks)
    is_json_document(text)            a JSON object or list (a JSON file given where a text
                                      format belongs)
    file_error(path, problem, fix)    the error itself: "PATH: PROBLEM; FIX"

`fix` says what the file must be or what to do; `error` is the exception class raised with the
line: the caller's ConfigError subclass (DataError for data files, ConvertError for conversions),
so each command prints the line and exits 2 as for any other bad input (or SystemExit, for a
tool whose errors end it with the line). No torch, nothing of the package but ConfigError.
"""
from __future__ import annotations

import codecs
import json
import os

from megatron_2bw.config.choices import ConfigError


def file_error(path, problem: str, fix: str, error: type = ConfigError) -> ConfigError:
    """The one-line error "PATH: PROBLEM; FIX" (raise it)."""
    return error(f"{os.fspath(path)}: {problem}; {fix}")


def read_bytes(path, fix: str, error: type = ConfigError) -> bytes:
    if os.path.isdir(path):
        raise file_error(path, "a directory, not a file", fix, error)
    try:
        with open(path, "rb") as f:
            return f.read()
    except FileNotFoundError:
        raise file_error(path, "no such file", fix, error) from None
    except OSError as e:
        raise file_error(path, f"cannot be read ({e.strerror or type(e).__name__})", fix,
                         error) from None


def _line_of(data: bytes, offset: int) -> int:
    return data.count(b"\n", 0, offset) + 1


def decode_problem(data: bytes) -> tuple[str, str] | None:
    """(why `data` is not UTF-8 text, the advice), or None when it is."""
    if data.startswith((codecs.BOM_UTF16_LE, codecs.BOM_UTF16_BE)):
        return ("UTF-16 text (it starts with a UTF-16 byte-order mark), not UTF-8",
                "save it as UTF-8")
    head = data[:1 << 16]
    controls = sum(b < 9 or 13 < b < 32 for b in head)
    if b"\x00" in head or controls > len(head) // 100:
        return "binary data, not text", "check it is the right file"
    try:
        data.decode("utf-8")
    except UnicodeDecodeError as e:
        return (f"not UTF-8 text (byte 0x{data[e.start]:02x} at offset {e.start}, line "
                f"{_line_of(data, e.start)}: Latin-1 or another encoding?)", "save it as UTF-8")
    return None


def read_text(path, fix: str, error: type = ConfigError) -> str:
    data = read_bytes(path, fix, error)
    problem = decode_problem(data)
    if problem:
        raise file_error(path, problem[0], f"{problem[1]}: {fix}", error)
    return data.decode("utf-8-sig")


def json_kind(value) -> str:
    """What a JSON value is, in words: "a JSON object", "a JSON list", "a string", ..."""
    if isinstance(value, dict):
        return "a JSON object"
    if isinstance(value, list):
        return "a JSON list"
    if isinstance(value, bool):
        return f"the boolean {json.dumps(value)}"
    if value is None:
        return "null"
    if isinstance(value, (int, float)):
        return f"the number {json.dumps(value)}"
    return f"the string {json.dumps(value)[:40]}"


def parse_json(path, text: str, fix: str, error: type = ConfigError):
    """json.loads(text) of the file `path`, a decode error as one line (a text cut short is
    named: it ends inside a value)."""
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        short = e.pos >= len(text.rstrip()) or e.msg.startswith("Unterminated string")
        problem = (f"not valid JSON ({e.msg}, line {e.lineno} column {e.colno}"
                   + ("; it ends inside a value: is the file cut short?)" if short else ")"))
        raise file_error(path, problem, fix, error) from None
    except RecursionError:
        raise file_error(path, "not valid JSON (nested too deeply)", fix, error) from None


def is_json_document(text: str) -> bool:
    """True when `text` is a JSON object or list (a JSON file given where a text format
    belongs, e.g. vocab.json as --merge-file)."""
    if text.lstrip()[:1] not in ("{", "["):
        return False
    try:
        return isinstance(json.loads(text), (dict, list))
    except (ValueError, RecursionError):
        return False


def read_json(path, fix: str, expect: type | None = dict, error: type = ConfigError):
    """The JSON document in `path`, of type `expect` (None: any)."""
    value = parse_json(path, read_text(path, fix, error), fix, error)
    if expect is not None and not isinstance(value, expect):
        want = {dict: "a JSON object {...}", list: "a JSON list [...]"}.get(expect, expect.__name__)
        raise file_error(path, f"{json_kind(value)} where {want} belongs", fix, error)
    return value
