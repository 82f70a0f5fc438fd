"""`python -m hpcdl.nn summary`: parameter and buffer counts, output shapes, the table, the
JSON last line, users' models, and one-line errors."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from hpcdl import nn
from hpcdl.nn.__main__ import main
from hpcdl.nn.summary import layer_rows

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = REPO / "examples" / "my_model.py"
USER_MODELS = Path(__file__).resolve().parent / "test_nn_user_models.py"
ERROR = "python -m hpcdl.nn summary: error: "


def summary_json(capsys, model: str, shape: str, classes: int) -> tuple[dict, str]:
    """(the JSON last line, everything printed before it) of an in-process summary --json."""
    status = main(
        ["summary", model, "--input-shape", shape, "--num-classes", str(classes), "--json"]
    )
    out = capsys.readouterr().out
    assert status == 0
    *table, last = out.rstrip("\n").split("\n")
    return json.loads(last), "\n".join(table)


@pytest.mark.parametrize(
    "model,parameters,buffers,stem,last_block",
    [
        ("resnet18", 11_689_512, 9_600, [64, 112, 112], [512, 7, 7]),
        ("resnet50", 25_557_032, 53_120, [64, 112, 112], [2048, 7, 7]),
    ],
)
def test_imagenet_resnets_report_torchvisions_counts(
    capsys, model, parameters, buffers, stem, last_block
):
    record, table = summary_json(capsys, model, "3,224,224", 1000)
    assert (record["parameters"], record["buffers"]) == (parameters, buffers)
    assert record["model"] == model and record["input_shape"] == [3, 224, 224]
    layers = record["layers"]
    assert [layer["output_shape"] for layer in layers[:4]] == [stem, stem, stem, [64, 56, 56]]
    assert layers[-3]["output_shape"] == last_block
    assert [layer["name"] for layer in layers[-2:]] == [
        f"{len(layers) - 2}.GlobalAvgPool",
        f"{len(layers) - 1}.Linear",
    ]
    assert layers[-1]["output_shape"] == [1000]
    assert sum(layer["parameters"] for layer in layers) == parameters
    assert sum(layer["buffers"] for layer in layers) == buffers
    assert f"Parameters: {parameters:,} " in table and f"Buffers:    {buffers:,} " in table


def test_the_table_has_one_row_per_layer_with_shape_and_count(capsys):
    record, table = summary_json(capsys, "cnn", "3,32,32", 10)
    lines = table.split("\n")
    assert lines[0] == "Model: cnn  input (C, H, W) = (3, 32, 32), 10 classes"
    assert lines[2].split() == ["Layer", "Output", "shape", "Param", "#"]
    rows = [line.split("  ") for line in lines[4:-3]]
    rows = [[cell.strip() for cell in row if cell.strip()] for row in rows]
    assert len(rows) == len(record["layers"]) == 17
    assert rows[0] == ["0.Conv2d", "(32, 32, 32)", "896"]
    assert rows[-1] == ["16.Linear", "(10,)", "5,130"]
    assert record["parameters"] == 1_250_858  # the Keras cifar10_cnn example


@pytest.mark.parametrize("name", nn.MODELS)
def test_rows_add_up_to_the_model_and_leave_it_unchanged(name):
    model = nn.build_model(name, (3, 16, 16), 7, seed=1)
    params, buffers = model.params.copy(), model.buffers.copy()
    rows = layer_rows(model)
    assert sum(r.parameters for r in rows) == model.num_params
    assert sum(r.buffers for r in rows) == model.buffers.size
    assert rows[-1].output_shape == (7,)
    # Evaluation mode: BatchNorm statistics and the dropout RNG are left as they were.
    np.testing.assert_array_equal(model.params, params)
    np.testing.assert_array_equal(model.buffers, buffers)
    assert model.get_rng_state() == nn.build_model(name, (3, 16, 16), 7, seed=1).get_rng_state()


def test_a_users_list_builder_is_summarised_by_module_spec(capsys):
    record, _ = summary_json(capsys, "test_nn_user_models:returns_layers", "3,6,5", 4)
    assert record["model"] == "test_nn_user_models:returns_layers"
    names = [layer["name"] for layer in record["layers"]]
    assert names == ["0.Conv2d", "1.BatchNorm", "2.ReLU", "3.Dropout", "4.Flatten", "5.Linear"]
    assert record["layers"][4]["output_shape"] == [120]
    assert (record["parameters"], record["buffers"]) == (108 + 8 + 120 * 4 + 4, 8)


def test_the_example_model_is_summarised_from_the_command_line():
    proc = subprocess.run(
        [sys.executable, "-m", "hpcdl.nn", "summary", f"{EXAMPLE}:build"]
        + ["--input-shape", "3,32,32", "--num-classes", "10", "--json"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    record = json.loads(proc.stdout.splitlines()[-1])
    assert record["model"] == "my_model:build"
    assert record["layers"][-3:][0]["output_shape"] == [256]  # global average pool
    assert record["layers"][-1]["output_shape"] == [10]
    assert record["parameters"] == 1_175_786 and record["buffers"] == 1_920
    assert "Parameters: 1,175,786 " in proc.stdout


@pytest.mark.parametrize(
    "args,message",
    [
        (["cnn", "--input-shape", "3,32"], "--input-shape must be C,H,W (three positive integers)"),
        (["cnn", "--input-shape", "3,x,32"], "got '3,x,32'"),
        (["cnn", "--input-shape", "3,0,32"], "got '3,0,32'"),
        (["cnn", "--input-shape", "3,32,32", "--num-classes", "1"], "--num-classes must be >= 2"),
        (["vgg16", "--input-shape", "3,32,32"], "unknown model 'vgg16'; choose one of mlp, cnn"),
        ([f"{USER_MODELS}:absent", "--input-shape", "3,6,5"], "has no attribute 'absent'"),
        (["missing_file.py:build", "--input-shape", "3,6,5"], "missing_file.py is not a file"),
        (
            [f"{USER_MODELS}:ends_with_three_outputs", "--input-shape", "3,6,5"],
            "gives (3,) per sample, not (10,) logits",
        ),
        (
            [f"{USER_MODELS}:misjudges_its_input", "--input-shape", "3,6,5"],
            "layer 1.Linear cannot take input (90,): ValueError: ",
        ),
        ([f"{USER_MODELS}:raises", "--input-shape", "3,6,5"], "raised RuntimeError: out of ideas"),
    ],
)
def test_each_wrong_input_is_one_error_line_and_status_2(capsys, args, message):
    if "--num-classes" not in args:
        args = [*args, "--num-classes", "10"]
    assert main(["summary", *args, "--json"]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert err.count("\n") == 1 and err.startswith(ERROR), err
    assert message in err, err
