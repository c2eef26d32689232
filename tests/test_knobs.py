"""The table of knobs (csrc/common/knobs.cc): every variable the sources name is in it, the
documentation is generated from it, and each type parses as the core's readers parse it."""

import os
import re

import pytest

from ringcomm import _C, _env, _knobs

pytestmark = pytest.mark.transport_fixed

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PAGE = os.path.join(ROOT, "docs", "configuration.md")
# A name, or a prefix such as RINGCOMM_SHM_* when it ends with "_".
NAME = re.compile(r"RINGCOMM_[A-Z0-9_]+")


def source_texts(*folders):
    """(path, text) of every text file under `folders` (of the checkout)."""
    for folder in folders:
        for root, dirs, files in os.walk(os.path.join(ROOT, folder)):
            dirs[:] = [d for d in dirs if d != "__pycache__"]
            for name in files:
                with open(os.path.join(root, name), "rb") as f:
                    data = f.read()
                if b"\0" not in data:  # not a built library
                    yield os.path.join(root, name), data.decode("utf-8", "replace")


def test_every_variable_the_sources_name_is_in_the_table():
    listed = {row["name"] for row in _C.knobs()}
    missing = {}
    for path, text in source_texts("csrc", "ringcomm", "examples", "bench"):
        for name in NAME.findall(text):
            if not name.endswith("_") and name not in listed:
                missing.setdefault(name, os.path.relpath(path, ROOT))
    assert not missing, f"not in csrc/common/knobs.cc: {missing}"


def test_every_row_is_read_somewhere():
    texts = [
        text
        for path, text in source_texts("csrc", "ringcomm", "examples", "bench")
        if not path.endswith(os.path.join("common", "knobs.cc"))
    ]
    with open(os.path.join(ROOT, "setup.py")) as f:
        texts.append(f.read())
    unread = [row["name"] for row in _C.knobs() if not any(row["name"] in t for t in texts)]
    assert not unread


def test_the_page_holds_the_generated_section():
    with open(PAGE) as f:
        page = f.read()
    assert _knobs.splice(page, _knobs.markdown()) == page, (
        "docs/configuration.md differs from the table: make docs"
    )


def test_no_line_of_the_page_is_over_160_characters():
    with open(PAGE) as f:
        long = [n for n, line in enumerate(f, 1) if len(line.rstrip("\n")) > 160]
    assert not long, f"docs/configuration.md lines {long}"


def test_each_section_is_one_run_of_rows():
    sections = [row["section"] for row in _C.knobs()]
    runs = [s for i, s in enumerate(sections) if i == 0 or sections[i - 1] != s]
    assert len(runs) == len(set(runs)), runs


def test_a_name_not_in_the_table_fails():
    for read in (_env.env_int, _env.env_flag, _env.env_string):
        with pytest.raises(RuntimeError, match="RINGCOMM_NO_SUCH_KNOB is not in the knob table"):
            read("RINGCOMM_NO_SUCH_KNOB")
    with pytest.raises(RuntimeError, match="RINGCOMM_DEBUG is a flag knob"):
        _env.env_int("RINGCOMM_DEBUG")


@pytest.mark.parametrize(
    "value,expected", [(None, 8), ("", 8), ("12", 12), (" 12", 12), ("+3", 3), ("-4", -4)]
)
def test_an_int_reads_as_strtoll_reads_it(monkeypatch, value, expected):
    if value is not None:
        monkeypatch.setenv("RINGCOMM_SHM_SLOTS", value)
    else:
        monkeypatch.delenv("RINGCOMM_SHM_SLOTS", raising=False)
    assert _env.env_int("RINGCOMM_SHM_SLOTS") == expected


@pytest.mark.parametrize("value", ["12 ", "1.5", "0x10", "lots"])
def test_anything_else_is_not_an_integer(monkeypatch, value):
    monkeypatch.setenv("RINGCOMM_TIMELINE_MAX_EVENTS", value)
    with pytest.raises(
        ValueError, match=f"RINGCOMM_TIMELINE_MAX_EVENTS={re.escape(value)} is not an integer"
    ):
        _env.env_int("RINGCOMM_TIMELINE_MAX_EVENTS")


def test_a_size_is_not_negative_and_auto_is_worked_out(monkeypatch):
    monkeypatch.setenv("RINGCOMM_TREE_CHUNK_BYTES", "-1")
    with pytest.raises(ValueError, match="RINGCOMM_TREE_CHUNK_BYTES must be >= 0, got -1"):
        _env.env_int("RINGCOMM_TREE_CHUNK_BYTES")
    monkeypatch.delenv("RINGCOMM_RING_SLICE_BYTES", raising=False)
    assert _env.env_int("RINGCOMM_RING_SLICE_BYTES") is None
    monkeypatch.setenv("RINGCOMM_RING_SLICE_BYTES", "auto")
    assert _env.env_int("RINGCOMM_RING_SLICE_BYTES") is None
    monkeypatch.setenv("RINGCOMM_TREE_CHUNK_BYTES", "auto")  # its default is a number
    with pytest.raises(ValueError, match="is not an integer"):
        _env.env_int("RINGCOMM_TREE_CHUNK_BYTES")


@pytest.mark.parametrize(
    "value,on", [(None, False), ("", False), ("0", False), ("1", True), ("INFO", True)]
)
def test_a_flag_is_on_when_set_to_anything_but_0(monkeypatch, value, on):
    if value is not None:
        monkeypatch.setenv("RINGCOMM_DEBUG", value)
    else:
        monkeypatch.delenv("RINGCOMM_DEBUG", raising=False)
    assert _env.env_flag("RINGCOMM_DEBUG") is on


def test_a_switch_is_0_or_1(monkeypatch):
    monkeypatch.delenv("RINGCOMM_SHM_UNSTACK", raising=False)
    assert _env.env_flag("RINGCOMM_SHM_UNSTACK") is True
    monkeypatch.setenv("RINGCOMM_SHM_UNSTACK", "0")
    assert _env.env_flag("RINGCOMM_SHM_UNSTACK") is False
    monkeypatch.setenv("RINGCOMM_SHM_UNSTACK", "2")
    with pytest.raises(ValueError, match="RINGCOMM_SHM_UNSTACK must be 0 or 1, got 2"):
        _env.env_flag("RINGCOMM_SHM_UNSTACK")


def test_an_enum_takes_its_values_alone(monkeypatch):
    monkeypatch.delenv("RINGCOMM_TRANSPORT", raising=False)
    assert _env.env_string("RINGCOMM_TRANSPORT") == "auto"
    monkeypatch.setenv("RINGCOMM_TRANSPORT", "tcp")
    assert _env.env_string("RINGCOMM_TRANSPORT") == "tcp"
    monkeypatch.setenv("RINGCOMM_TRANSPORT", "udp")
    with pytest.raises(
        ValueError, match="RINGCOMM_TRANSPORT=udp: expected one of auto, shm, or tcp"
    ):
        _env.env_string("RINGCOMM_TRANSPORT")
    names = [row for row in _C.knobs() if row["name"] == "RINGCOMM_ALGO"][0]["values"]
    assert sorted(names) == sorted(_C.ALGORITHM_CODES)


def test_a_string_reads_as_set_else_its_default_value(monkeypatch):
    monkeypatch.delenv("RINGCOMM_TORCH_BUILD_DIR", raising=False)
    assert _env.env_string("RINGCOMM_TORCH_BUILD_DIR") == "~/.cache/ringcomm"
    monkeypatch.delenv("RINGCOMM_HOST_ID", raising=False)
    assert _env.env_string("RINGCOMM_HOST_ID") == ""  # "(derived)": the reader works it out
    monkeypatch.setenv("RINGCOMM_HOST_ID", "a")
    assert _env.env_string("RINGCOMM_HOST_ID") == "a"
