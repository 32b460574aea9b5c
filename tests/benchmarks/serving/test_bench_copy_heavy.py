"""benchmarks/serving/bench_serving.py's copy-heavy dataset: each prompt holds the text its answer must reuse."""

from __future__ import annotations

import json
import re

import numpy as np

from benchmarks.serving import bench_serving as bench


def test_copy_heavy_rows():
    rows = bench.sample_copy_heavy_requests(None, np.random.default_rng(0), 9, num_sentences=4, output_len=77)
    assert len(rows) == 9 and all(r.output_len == 77 and r.prompt_ids is None for r in rows)
    rewrite, code, extract = rows[0].prompt, rows[1].prompt, rows[2].prompt
    passage = rewrite.split("Passage:\n")[1].split("\n\nCopy:")[0]
    assert len(re.findall(r"[A-Z][a-z ]+\.", passage)) == 4  # four sentences to copy
    assert code.count("def ") == 4 and code.count("(items,") == 4 and code.endswith("```python\n")
    doc = extract.split("Document:\n")[1].split("\nNotes:")[0]
    fields = dict(line.split(": ", 1) for line in doc.splitlines())
    assert set(fields) == {"Name", "Street", "City", "Company", "Title", "Department", "Project", "Manager"}
    json.dumps(fields)
    assert rows[3].prompt.startswith("Copy the passage") and rows[3].prompt != rewrite
    assert all(r.prompt_len == bench.estimate_num_tokens(r.prompt) for r in rows)


def test_copy_heavy_cli():
    args = bench.parse_args(["--dataset-name", "copy-heavy", "--num-prompts", "3", "--copy-num-sentences", "2",
                             "--copy-output-len", "5"])
    rows = bench.build_dataset(args, None, np.random.default_rng(1))
    assert [r.output_len for r in rows] == [5, 5, 5]
