"""The model census's layer counts (hf_paged/bench/census_layers.py): 2 layers for a plain transformer, the fewest
N >= 4 holding every layer type for a mixed stack, then counts holding each type twice, three times."""
import itertools

from transformers import CONFIG_MAPPING

from hf_paged.bench import census_layers


def first_plans(model_type: str, count: int = 3):
    config = CONFIG_MAPPING[model_type](**census_layers.REPRESENTATIVE.get(model_type, {}))
    return config, list(itertools.islice(census_layers.plans(config.get_text_config(decoder=True)), count))


def test_a_plain_transformer_gets_two_layers_and_no_pattern():
    config, plans = first_plans("llama")
    assert plans == [(census_layers.PLAIN, None)]
    assert census_layers.count_name(config) == "num_hidden_layers"
    assert census_layers.kinds(config) == set()


def test_alternating_attention_fits_in_two_layers_with_both_kinds():
    config, plans = first_plans("gemma2")
    assert len(plans) == 1
    layers, small = plans[0]
    assert layers == 2 and census_layers.kinds(small) == census_layers.kinds(config) == {"sliding_attention",
                                                                                          "full_attention"}


def test_a_hybrid_stack_gets_the_fewest_layers_holding_each_type_then_more():
    config, plans = first_plans("qwen3_next")
    wanted = census_layers.kinds(config)
    assert wanted == {"linear_attention", "full_attention"}
    (n1, small1), (n2, small2) = plans[:2]
    assert census_layers.MIXED <= n1 < n2
    record = census_layers.described(small1)
    assert record["layers"] == n1
    types = record["layer_types"]["layer_types"]
    assert len(types) == n1 and set(types) == wanted
    twice = census_layers.patterns(small2)["layer_types"]
    assert all(twice.count(kind) >= 2 for kind in wanted)


def test_a_representative_pattern_where_the_default_config_has_none():
    assert census_layers.kinds(CONFIG_MAPPING["lfm2"]()) == {"full_attention"}  # the default: attention only
    config, plans = first_plans("lfm2")
    assert census_layers.kinds(config) == {"conv", "full_attention"}
    assert census_layers.kinds(plans[0][1]) == {"conv", "full_attention"}


def test_adopt_copies_the_pattern_onto_a_shrunk_config():
    config, plans = first_plans("qwen3_next", 1)
    layers, small = plans[0]
    shrunk = CONFIG_MAPPING["qwen3_next"](num_hidden_layers=layers)
    shrunk.layer_types = ["full_attention"] * layers
    census_layers.adopt(shrunk, small)
    assert shrunk.layer_types == small.layer_types
    census_layers.adopt(shrunk, None)  # a plain transformer's plan: nothing to copy
    assert shrunk.layer_types == small.layer_types
