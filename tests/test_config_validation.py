"""Config checks the type of every field, not just its value (issue 12 item 14), and refuses or
warns about settings the other settings make ineffective. Dicts and JSON files take the same path."""

from __future__ import annotations

import dataclasses
import json
import math
import tempfile
import typing
import warnings
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fxspeed.config import LR_SCHEDULES, Config, ConfigWarning
from fxspeed.errors import ConfigError

FLOAT_FIELDS = ("lr", "eps", "weight_decay", "momentum", "grad_clip", "loss_scale", "loss_scale_backoff",
                "loss_scale_growth", "bucket_mb", "dist_timeout_s")
INT_FIELDS = ("warmup_steps", "total_steps", "zero", "pipeline", "tensor", "microbatches", "grad_accum",
              "loss_scale_window", "seed", "pipeline_chunks")


def quiet(**kw: typing.Any) -> Config:
    """Config(**kw) with ConfigWarnings silenced (for tests about something else)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ConfigWarning)
        return Config(**kw)


# --- strings for name lists ------------------------------------------------------------------

def test_a_string_for_fp32_modules_is_not_split_into_characters():
    assert quiet(precision="bf16", fp32_modules="head").fp32_modules == ("head",)


def test_a_string_for_disable_passes_is_one_pass_name():
    assert Config(disable_passes="dedupe_tied_parameters").disable_passes == ("dedupe_tied_parameters",)


def test_a_string_for_split_points_is_refused_with_a_list_suggested():
    with pytest.raises(ConfigError, match=r"Config\.split_points='ln_f' is invalid.*\['ln_f'\]"):
        Config(pipeline=2, microbatches=2, split_points="ln_f")


def test_a_string_for_betas_is_refused_not_read_character_by_character():
    with pytest.raises(ConfigError, match=r"Config\.betas='09' is invalid.*list of 2 finite numbers"):
        Config(betas="09")


def test_a_name_list_holding_a_non_string_is_refused_naming_the_key_and_the_item():
    with pytest.raises(ConfigError, match=r"Config\.fp32_modules\[1\]=1 is invalid; it must be a string, not int"):
        Config(precision="bf16", fp32_modules=["head", 1])


def test_a_number_for_a_name_list_is_refused():
    with pytest.raises(ConfigError, match=r"Config\.disable_passes=5 is invalid; it must be a list of strings"):
        Config(disable_passes=5)


# --- numbers ----------------------------------------------------------------------------------

@pytest.mark.parametrize("key", FLOAT_FIELDS)
@pytest.mark.parametrize("value", [math.inf, -math.inf, math.nan], ids=["inf", "-inf", "nan"])
def test_an_infinite_or_nan_number_is_refused_for_every_float_field(key: str, value: float):
    with pytest.raises(ConfigError, match=rf"Config\.{key}={value!r} is invalid; it must be a finite number"):
        Config(**{key: value})


def test_an_infinite_learning_rate_is_refused():
    with pytest.raises(ConfigError, match=r"Config\.lr=inf is invalid; it must be a finite number"):
        Config(lr=float("inf"))


def test_a_nan_beta_is_refused_naming_betas():
    with pytest.raises(ConfigError, match=r"Config\.betas\[1\]=nan is invalid.*in Config\.betas="):
        Config(betas=(0.9, float("nan")))


def test_betas_of_the_wrong_length_are_refused():
    with pytest.raises(ConfigError, match=r"Config\.betas=\(0\.9,\) is invalid; it must be a list of 2"):
        Config(betas=(0.9,))


def test_true_for_zero_is_refused_not_taken_as_stage_1():
    with pytest.raises(ConfigError, match=r"Config\.zero=True is invalid; it must be an integer, not bool "
                                          r"\(use zero=1\); accepted values: 0, 1, 2, 3"):
        Config(zero=True)


def test_a_float_for_zero_is_refused_even_if_integral_and_the_error_says_use_1():
    with pytest.raises(ConfigError, match=r"Config\.zero=1\.0 is invalid; it must be an integer, not float "
                                          r"\(use zero=1\)"):
        Config(zero=1.0)


@pytest.mark.parametrize("key", [k for k in INT_FIELDS if k != "zero"])
def test_an_integral_float_is_refused_for_every_int_field(key: str):
    with pytest.raises(ConfigError, match=rf"Config\.{key}=2\.0 is invalid; it must be an integer.*use {key}=2"):
        quiet(**{key: 2.0})


def test_a_string_seed_is_refused():
    with pytest.raises(ConfigError, match=r"Config\.seed='a' is invalid; it must be an integer or None, not str"):
        Config(seed="a")


def test_a_digit_string_seed_is_refused_with_the_number_suggested():
    with pytest.raises(ConfigError, match=r"Config\.seed='3' is invalid.*\(use seed=3\)"):
        Config(seed="3")


def test_a_numeric_string_for_the_learning_rate_is_refused_with_the_number_suggested():
    with pytest.raises(ConfigError, match=r"Config\.lr='3e-4' is invalid; it must be a finite number, not str "
                                          r"\(use lr=0\.0003\)"):
        Config(lr="3e-4")


@pytest.mark.parametrize("key", ["lr", "grad_clip", "pipeline", "grad_accum", "seed"])
def test_a_bool_is_refused_for_a_number_field(key: str):
    with pytest.raises(ConfigError, match=rf"Config\.{key}=True is invalid; it must be .*, not bool"):
        Config(**{key: True})


def test_ints_are_accepted_for_float_fields_and_stored_as_floats():
    c = Config(lr=1, grad_clip=2, bucket_mb=25, dist_timeout_s=60)
    assert (c.lr, c.grad_clip, c.bucket_mb, c.dist_timeout_s) == (1.0, 2.0, 25.0, 60.0)
    assert all(type(v) is float for v in (c.lr, c.grad_clip, c.bucket_mb, c.dist_timeout_s))


def test_an_int_for_layer_extrapolation_is_refused():
    with pytest.raises(ConfigError, match=r"Config\.layer_extrapolation=1 is invalid.*accepted values: True, False"):
        Config(layer_extrapolation=1)


def test_a_number_for_a_choice_is_refused_naming_the_accepted_values():
    with pytest.raises(ConfigError, match=r"Config\.optimizer=1 is invalid; it must be a string, not int; "
                                          r"accepted values: 'adamw', 'adam', 'sgd'"):
        Config(optimizer=1)


# --- settings the optimizer does not read -----------------------------------------------------

@pytest.mark.parametrize("optimizer", ["adamw", "adam"])
def test_momentum_with_an_adam_optimizer_is_an_error_naming_sgd(optimizer: str):
    with pytest.raises(ConfigError, match=rf"Config\.momentum=0\.9 has no effect with optimizer='{optimizer}'; "
                                          r"momentum is used only by optimizer 'sgd'"):
        Config(optimizer=optimizer, momentum=0.9)


@pytest.mark.parametrize("setting", [{"betas": (0.8, 0.99)}, {"eps": 1e-6}], ids=["betas", "eps"])
def test_betas_or_eps_with_sgd_is_an_error_naming_the_adam_optimizers(setting: dict):
    (key,) = setting
    with pytest.raises(ConfigError, match=rf"Config\.{key}=.* has no effect with optimizer='sgd'; {key} is used only "
                                          r"by optimizers 'adamw' and 'adam'"):
        Config(optimizer="sgd", **setting)


@pytest.mark.parametrize("optimizer", ["adamw", "adam", "sgd"])
def test_the_default_optimizer_settings_are_fine_with_every_optimizer(optimizer: str):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        Config(optimizer=optimizer, momentum=0.0, betas=[0.9, 0.999], eps=1e-8)


# --- settings that have no effect warn ----------------------------------------------------------

@pytest.mark.parametrize("kw, key", [
    (dict(total_steps=100), "total_steps"),
    (dict(loss_scale=1024.0), "loss_scale"),
    (dict(precision="bf16", loss_scale_window=10), "loss_scale_window"),
    (dict(fp32_modules=["head"]), "fp32_modules"),
    (dict(schedule="zb"), "schedule"),
    (dict(split_points=["ln_f"]), "split_points"),
    (dict(pipeline=2, microbatches=2, schedule="gpipe", pipeline_chunks=3), "pipeline_chunks"),
], ids=lambda x: x if isinstance(x, str) else None)
def test_a_setting_with_no_effect_warns_naming_the_key(kw: dict, key: str):
    with pytest.warns(ConfigWarning, match=rf"Config\.{key}=.* has no effect") as w:
        Config(**kw)
    assert [r.filename for r in w] == [__file__]  # points at the Config(...) line


@pytest.mark.parametrize("kw", [
    dict(), dict(optimizer="sgd", momentum=0.9), dict(lr_schedule="cosine", total_steps=100, warmup_steps=10),
    dict(precision="fp16", loss_scale=1024.0, loss_scale_window=10), dict(precision="bf16", fp32_modules=["head"]),
    dict(pipeline=2, microbatches=4, schedule="interleaved", pipeline_chunks=3),
    dict(pipeline=2, microbatches=2, schedule="zb", split_points=["ln_f"]),
], ids=str)
def test_settings_that_take_effect_do_not_warn(kw: dict):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        Config(**kw)


# --- dicts, JSON files, assignment --------------------------------------------------------------

def test_a_dict_goes_through_the_same_type_checks():
    with pytest.raises(ConfigError, match=r"Config\.zero=1\.0 is invalid.*use zero=1"):
        Config.coerce({"zero": 1.0})
    assert quiet(**{"precision": "bf16"}) == Config.coerce({"precision": "bf16"})


def test_a_json_file_goes_through_the_same_type_checks(tmp_path: Path):
    good = tmp_path / "good.json"
    good.write_text(json.dumps({"precision": "bf16", "fp32_modules": "head", "betas": [0.8, 0.99]}))
    c = Config.coerce(str(good))
    assert c.fp32_modules == ("head",) and c.betas == (0.8, 0.99)
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"zero": True}))
    with pytest.raises(ConfigError, match=r"Config\.zero=True is invalid"):
        Config.coerce(bad)


def test_json_lists_for_tuple_fields_round_trip(tmp_path: Path):
    c = Config(pipeline=2, microbatches=4, schedule="interleaved", pipeline_chunks=2, precision="bf16",
               fp32_modules=["head"], disable_passes=["dedupe_tied_parameters"], split_points=["b.1", "b.2", "ln_f"],
               betas=[0.8, 0.99], lr=1, seed=0)
    path = tmp_path / "c.json"
    c.to_json(path)
    assert json.loads(path.read_text())["betas"] == [0.8, 0.99]
    assert Config.from_json(path) == c == Config.coerce(str(path))


def test_invalid_json_names_the_file(tmp_path: Path):
    path = tmp_path / "broken.json"
    path.write_text('{"lr": 0.1,')
    with pytest.raises(ConfigError, match=r"broken\.json' is not valid JSON"):
        Config.from_json(path)


def test_a_json_file_holding_a_list_is_refused_clearly(tmp_path: Path):
    path = tmp_path / "list.json"
    path.write_text("[1, 2]")
    with pytest.raises(ConfigError, match=r"built from a dict of settings \(a JSON object\), got list"):
        Config.coerce(path)


def test_a_field_assigned_after_construction_is_checked_when_the_config_is_used():
    c = Config()
    c.zero = True  # type: ignore[assignment]
    with pytest.raises(ConfigError, match=r"Config\.zero=True is invalid"):
        Config.coerce(c)


def test_numpy_numbers_are_accepted_and_stored_as_python_numbers():
    np = pytest.importorskip("numpy")
    c = Config(zero=np.int64(2), lr=np.float32(0.5), seed=np.int32(7))
    assert (type(c.zero), type(c.lr), type(c.seed)) == (int, float, int) and (c.zero, c.lr, c.seed) == (2, 0.5, 7)
    with pytest.raises(ConfigError, match=r"Config\.zero=.* is invalid; it must be an integer"):
        Config(zero=np.float64(1.0))


# --- properties ---------------------------------------------------------------------------------

finite = dict(allow_nan=False, allow_infinity=False)
names = st.lists(st.text(min_size=1, max_size=8), max_size=3)


@st.composite
def valid_configs(draw: st.DrawFn) -> dict:
    d: dict[str, typing.Any] = {}
    d["optimizer"] = draw(st.sampled_from(["adamw", "adam", "sgd"]))
    if d["optimizer"] == "sgd":
        d["momentum"] = draw(st.floats(0, 10, **finite))
    else:
        d["betas"] = draw(st.lists(st.floats(0, 1, exclude_max=True, **finite), min_size=2, max_size=2))
        d["eps"] = draw(st.floats(0, 1, exclude_min=True, **finite))
    d["lr"] = draw(st.floats(0, 10, **finite) | st.integers(0, 10))
    d["weight_decay"] = draw(st.floats(0, 1, **finite))
    d["grad_clip"] = draw(st.none() | st.floats(0, 1e3, exclude_min=True, **finite))
    d["lr_schedule"] = draw(st.sampled_from(LR_SCHEDULES))
    d["total_steps"] = draw(st.integers(1, 10**6)) if d["lr_schedule"] in ("linear", "cosine") else None
    d["warmup_steps"] = draw(st.integers(0, 1000))
    d["zero"] = draw(st.integers(0, 3))
    d["precision"] = draw(st.sampled_from(["fp32", "bf16", "fp16"]))
    d["pipeline"] = draw(st.integers(1, 4))
    d["schedule"] = draw(st.sampled_from(["gpipe", "1f1b", "interleaved", "zb"]))
    d["pipeline_chunks"] = draw(st.integers(1, 4))
    if d["pipeline"] > 1:
        step = d["pipeline"] if d["schedule"] == "interleaved" else 1
        d["microbatches"] = step * draw(st.integers(1, 4))
        stages = d["pipeline"] * (d["pipeline_chunks"] if d["schedule"] == "interleaved" else 1)
        d["split_points"] = draw(st.just([]) | st.lists(st.text(min_size=1, max_size=8), min_size=stages - 1,
                                                         max_size=stages - 1))
    d["tensor"] = draw(st.integers(1, 8))
    d["grad_accum"] = draw(st.integers(1, 8))
    kinds = ["none", "parameters", "activations"] + (["optimizer", "all"] if d["optimizer"] != "sgd" else [])
    d["offload"] = draw(st.sampled_from(kinds))
    if d["offload"] != "none":
        d["offload_device"] = draw(st.sampled_from(["auto", "nvme"]))
        d["nvme_path"] = draw(st.none() | st.text(min_size=1, max_size=12))
        d["memory_budget_gb"] = draw(st.none() | st.floats(0.01, 1e4, **finite))
    d["fp32_modules"] = draw(names | st.text(min_size=1, max_size=8))
    d["reduce_dtype"] = draw(st.sampled_from(["fp32", "bf16", "fp16"]))
    d["loss_scale"] = draw(st.none() | st.floats(1e-3, 2.0**24, **finite))
    d["loss_scale_window"] = draw(st.integers(1, 10**4))
    d["loss_scale_backoff"] = draw(st.floats(0, 1, exclude_min=True, exclude_max=True, **finite))
    d["loss_scale_growth"] = draw(st.floats(1, 16, exclude_min=True, **finite))
    d["bucket_mb"] = draw(st.floats(0, 1e4, exclude_min=True, **finite))
    d["dist_timeout_s"] = draw(st.floats(0, 1e6, exclude_min=True, **finite))
    d["disable_passes"] = draw(names)
    d["seed"] = draw(st.none() | st.integers(-(2**63), 2**64 - 1))
    d["layer_extrapolation"] = draw(st.sampled_from([True, False, "auto"]))
    return d


@settings(max_examples=200, deadline=None)
@given(valid_configs())
def test_random_valid_configs_round_trip_through_json(d: dict):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ConfigWarning)
        c = Config(**d)
        assert Config.coerce(json.loads(json.dumps(c.to_dict()))) == c
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / "c.json"
            c.to_json(path)
            assert Config.from_json(path) == c == Config.coerce(str(path))


_HINTS = typing.get_type_hints(Config)
_FIELDS = [f.name for f in dataclasses.fields(Config)]


def wrong_values(key: str) -> st.SearchStrategy:
    """Values whose type the annotation of `key` does not accept."""
    tp = _HINTS[key]
    args = typing.get_args(tp)
    optional = type(None) in args
    core = [a for a in args if a is not type(None)][0] if optional else tp
    none = st.nothing() if optional or key == "split_points" else st.none()  # split_points=None means ()
    lists = st.lists(st.integers(), min_size=1, max_size=3)
    bools, ints, floats, text = st.booleans(), st.integers(), st.floats(), st.text(max_size=5)
    if core is int:
        return none | bools | floats | text | lists
    if core is float:
        return none | bools | text | lists | st.sampled_from([math.inf, -math.inf, math.nan])
    if core is str:
        return none | bools | ints | floats | st.lists(text, max_size=2)
    if key == "betas":
        wrong_length = st.lists(st.floats(0, 0.5), max_size=3).filter(lambda x: len(x) != 2)
        return none | bools | ints | floats | text | wrong_length | st.tuples(st.booleans() | text, st.floats(0, 0.5))
    if typing.get_origin(core) is tuple:  # a list of names
        bad = none | bools | ints | floats | lists | st.dictionaries(text, text, min_size=1)
        return bad | text.filter(bool) if key == "split_points" else bad
    if key == "layer_extrapolation":
        return none | ints | floats | lists
    if core is bool:
        return none | ints | floats | text | lists
    raise AssertionError(f"no wrong values for Config.{key}: {tp}")  # a new field: add its type above


def test_every_field_has_wrong_values_to_try():
    for key in _FIELDS:
        wrong_values(key)


def test_an_integer_field_given_a_unicode_digit_that_is_not_a_number_raises_a_config_error():
    # '²'.isdigit() is True but int('²') raises ValueError (a hypothesis draw found it)
    with pytest.raises(ConfigError, match=r"Config\.seed='²' is invalid; it must be an integer"):
        Config(seed="²")
    with pytest.raises(ConfigError, match=r"\(use seed=12\)"):
        Config(seed=" 12")


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_a_wrong_typed_value_for_any_field_raises_a_config_error_naming_the_field(data: st.DataObject):
    key = data.draw(st.sampled_from(_FIELDS))
    value = data.draw(wrong_values(key))
    with pytest.raises(ConfigError, match=rf"Config\.{key}\b"):
        Config(**{key: value})
    with pytest.raises(ConfigError, match=rf"Config\.{key}\b"):
        Config.coerce({key: value})


def test_a_misspelt_keyword_to_config_is_a_config_error_naming_the_closest_key():
    with pytest.raises(ConfigError, match=r"did you mean 'zero' for 'zer0'\?"):
        Config(zer0=3)
    # another library's name for a key is mapped, not matched by letters ('sequence_parallel' was offered)
    for other, ours in (("tensor_parallel", "tensor"), ("clip_grad_norm", "grad_clip"), ("micro_batches", "microbatches"),
                        ("gradient_accumulation_steps", "grad_accum"), ("zero_stage", "zero"),
                        # DeepSpeed's / HF Trainer's lr scheduler: 'schedule' (the pipeline's) was offered
                        ("scheduler", "lr_schedule"), ("lr_scheduler", "lr_schedule"),
                        ("total_num_steps", "total_steps"), ("max_steps", "total_steps")):
        with pytest.raises(ConfigError, match=rf"did you mean '{ours}' for '{other}'\?"):
            Config(**{other: 2})
    with pytest.raises(ConfigError, match="unknown Config key"):
        Config(zero=1, not_a_setting=True)
    assert Config(zero=2).zero == 2 and dataclasses.replace(Config(), zero=1).zero == 1


@pytest.mark.parametrize("tensor,pipeline,match", [(128, 1, "use devices=128"), (3, 1, "tensor that divides 64"),
                                                   (2, 3, "not a multiple of Config.pipeline x Config.tensor")])
def test_plan_refuses_degrees_that_do_not_divide_the_devices_before_tracing(tensor: int, pipeline: int, match: str):
    import torch

    import fxspeed
    from fxspeed.models.gpt import GPT, GPTConfig

    with torch.device("meta"):  # 4 heads: tensor=128 would first fail on the heads if traced
        model = GPT(GPTConfig(n_layer=2, n_head=4, n_embd=64, vocab_size=128, block_size=32))
    x = torch.randint(0, 128, (2, 16))
    with pytest.raises(ConfigError, match=match):
        fxspeed.plan(model, 64, Config(tensor=tensor, pipeline=pipeline), example_inputs=(x, x))
