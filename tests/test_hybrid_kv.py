"""patches/src/hybrid_kv_accounting.py on its own: the property the adapter's config classes get."""

from __future__ import annotations

import importlib.util
from types import ModuleType
from typing import Any

import pytest
from conftest import REPO


def helper() -> ModuleType:
    spec = importlib.util.spec_from_file_location("hybrid_kv_accounting", REPO / "patches/src/hybrid_kv_accounting.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def configs() -> tuple[Any, Any]:
    kv = helper()

    class Text:
        layers_block_type = kv.layers_block_type

        def __init__(self, **kwargs: Any) -> None:
            self.num_hidden_layers = 8
            self.layer_types = ["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(8)]
            for key, value in kwargs.items():  # what PretrainedConfig does with config.json's other keys
                setattr(self, key, value)

    class Composite:
        layers_block_type = kv.layers_block_type

        def __init__(self) -> None:
            self.text_config = Text()

    return Text, Composite


def test_full_attention_by_default_and_legacy40_on_request(monkeypatch: pytest.MonkeyPatch) -> None:
    text, composite = configs()
    monkeypatch.delenv("HYBRID_KV_ACCOUNTING", raising=False)
    assert text().layers_block_type.count("attention") == 2
    assert composite().layers_block_type == text().layers_block_type  # the composite reads its text_config
    monkeypatch.setenv("HYBRID_KV_ACCOUNTING", "legacy40")
    assert composite().layers_block_type == ["attention"] * 8
    monkeypatch.setenv("HYBRID_KV_ACCOUNTING", "all")
    with pytest.raises(ValueError, match="expected one of full_attention, legacy40"):
        _ = text().layers_block_type


def test_a_serialized_value_must_agree_with_the_switch(monkeypatch: pytest.MonkeyPatch) -> None:
    text, _ = configs()
    monkeypatch.setenv("HYBRID_KV_ACCOUNTING", "full_attention")
    agreed = ["attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(8)]
    assert text(layers_block_type=agreed).layers_block_type == agreed
    with pytest.raises(ValueError, match="differs from HYBRID_KV_ACCOUNTING=full_attention"):
        text(layers_block_type=["attention"] * 8)


def test_the_flagship_default_is_the_helpers() -> None:
    from conftest import FLAGSHIP

    from toolkit.recipe import load_recipe

    rule = load_recipe(FLAGSHIP).recipe.model.layers_block_type  # type: ignore[union-attr]
    kv = helper()
    assert not isinstance(rule, bool)
    assert (rule.switch, rule.default, {rule.when, rule.otherwise}) == (kv.SWITCH, kv.DEFAULT, set(kv.MODES))
