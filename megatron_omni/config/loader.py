"""Build a :class:`RunConfig` from a recipe, a YAML file and dotted overrides, via OmegaConf structured configs.

Order of precedence (later wins): dataclass defaults < recipe < YAML file < ``a.b=c`` overrides.
OmegaConf does the type checking; its exceptions are rewritten here into one-line
:class:`ConfigError` messages that name the full dotted key and the expected type, e.g.

    parallel.tp: expected int, got 'two'
    unknown key 'parallel.tpp' (known: tp, cp, ulysses, pp, vpp, device)
    parallel.device: invalid choice 'gpu' (allowed: auto, cuda, npu, cpu)
"""
import dataclasses
import re
import typing
from pathlib import Path
from typing import Any, Literal, Optional, Sequence

import yaml
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import ConfigAttributeError, ConfigKeyError, OmegaConfBaseException, ValidationError

from .recipes import get_recipe
from .schema import ConfigError, RunConfig

_MISSING = object()  # the dotted key does not name a field of the schema


def load_config(recipe: Optional[str] = None, yaml_path: Optional[str] = None,
                overrides: Sequence[str] = ()) -> RunConfig:
    """The validated RunConfig: recipe (or the dataclass defaults), then the YAML file, then the overrides."""
    base = get_recipe(recipe) if recipe is not None else RunConfig()
    data = _read_yaml(yaml_path) if yaml_path is not None else None
    family = _family_named(data, overrides)
    if family is not None and family != base.model.family:  # model.arch is typed by the family: its default first
        base.model = dataclasses.replace(base.model, family=family, arch=None)
    cfg = OmegaConf.structured(base)
    if data is not None:
        _merge(cfg, data, source=f"in {yaml_path}")
    for item in overrides:
        key, sep, _ = item.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"override {item!r}: expected the form dotted.key=value (e.g. parallel.tp=2)")
        _merge(cfg, None, source=f"in override {item!r}", dotlist=[item])
    try:
        run = OmegaConf.to_object(cfg)  # real dataclass instances; tuples come back as tuples
    except OmegaConfBaseException as e:  # e.g. an interpolation ${...} that does not resolve
        raise _translate(e, source="", cfg=cfg) from None
    run.validate()
    return run


def _family_named(data: Optional[DictConfig], overrides: Sequence[str]) -> Optional[str]:
    """The ``model.family`` the YAML file or the overrides (the last one wins) set, if a registered one."""
    from model_specs.family import family_names

    family = OmegaConf.select(data, "model.family", default=None) if data is not None else None
    for item in overrides:
        key, sep, value = item.partition("=")
        if sep and key.strip() == "model.family":
            family = value.strip()
    return family if family in family_names() else None  # else the merge names the bad value


def config_to_yaml(cfg: RunConfig) -> str:
    """YAML text of ``cfg`` that :func:`load_config` reads back to an equal RunConfig."""
    return OmegaConf.to_yaml(OmegaConf.structured(cfg))


def _read_yaml(path: str) -> DictConfig:
    if not Path(path).is_file():
        raise ConfigError(f"config file {path!r} not found; expected a YAML file")
    try:
        data = OmegaConf.load(path)
    except yaml.YAMLError as e:
        raise ConfigError(f"config file {path!r} is not valid YAML: {' '.join(str(e).split())}") from None
    if not isinstance(data, DictConfig):
        raise ConfigError(f"config file {path!r}: expected a mapping of sections (parallel, model, ...), "
                          f"got a {type(data).__name__}")
    return data


def _merge(cfg: DictConfig, other: Optional[DictConfig], source: str, dotlist: Sequence[str] = ()) -> None:
    try:
        if dotlist:
            cfg.merge_with_dotlist(list(dotlist))
        else:
            cfg.merge_with(other)
    except OmegaConfBaseException as e:
        raise _translate(e, source, cfg) from None
    except TypeError as e:  # OmegaConf.merge raises a bare TypeError for a mapping given for a list
        raise ConfigError(f"{e} ({source})") from None


# ---- OmegaConf exception -> one clear message ------------------------------------------------------

def _translate(err: OmegaConfBaseException, source: str, cfg: Optional[DictConfig] = None) -> ConfigError:
    key = str(getattr(err, "full_key", None) or getattr(err, "key", None) or "")
    path = re.findall(r"[^.\[\]]+", key)  # "model.arch.axes_dims_rope[0]" -> model, arch, axes_dims_rope, 0
    suffix = f" ({source})" if source else ""
    parent = _strip_optional(_field_type(path[:-1], cfg)) if path else _MISSING
    if isinstance(err, (ConfigKeyError, ConfigAttributeError)) and dataclasses.is_dataclass(parent):
        known = ", ".join(f.name for f in dataclasses.fields(parent))
        return ConfigError(f"unknown key {key!r} (known: {known}){suffix}")
    if typing.get_origin(parent) is tuple:  # OmegaConf keeps tuples immutable: no item-wise override
        whole = key.rsplit("[", 1)[0]
        return ConfigError(f"{key}: a tuple is set as a whole; expected {whole}=[...] "
                           f"({_type_name(parent)}){suffix}")
    expected = _field_type(path, cfg) if path else _MISSING
    if isinstance(err, ValidationError) and expected is not _MISSING:
        value = getattr(err, "value", None)
        if typing.get_origin(expected) is Literal:
            allowed = ", ".join(str(a) for a in typing.get_args(expected))
            return ConfigError(f"{key}: invalid choice {value!r} (allowed: {allowed}){suffix}")
        return ConfigError(f"{key}: expected {_type_name(expected)}, got {value!r}{suffix}")
    msg = str(getattr(err, "msg", err)).splitlines()[0]  # OmegaConf appends full_key/object_type lines
    return ConfigError(f"{key + ': ' if key else ''}{msg}{suffix}")


def _field_type(path: Sequence[str], cfg: Optional[DictConfig] = None) -> Any:
    """The annotated type of the field at dotted ``path`` below RunConfig, or _MISSING.  A field typed ``Any``
    (``model.arch``: the model family's dataclass) takes the type of its value in ``cfg``."""
    tp: Any = RunConfig
    for i, part in enumerate(path):
        tp = _strip_optional(tp)
        if not dataclasses.is_dataclass(tp) or part not in {f.name for f in dataclasses.fields(tp)}:
            return _MISSING
        tp = typing.get_type_hints(tp)[part]
        if tp is Any and cfg is not None:
            node = OmegaConf.select(cfg, ".".join(path[:i + 1]), throw_on_missing=False)
            tp = OmegaConf.get_type(node) if isinstance(node, DictConfig) else Any
    return tp


def _strip_optional(tp: Any) -> Any:
    args = typing.get_args(tp)
    if typing.get_origin(tp) is typing.Union and type(None) in args:
        rest = [a for a in args if a is not type(None)]
        return rest[0] if len(rest) == 1 else tp
    return tp


def _type_name(tp: Any) -> str:
    inner = _strip_optional(tp)
    if inner is not tp:
        return f"{_type_name(inner)} or null"
    if dataclasses.is_dataclass(tp):
        return f"a section {tp.__name__} (keys: {', '.join(f.name for f in dataclasses.fields(tp))})"
    args = typing.get_args(tp)
    if typing.get_origin(tp) in (tuple, list) and args:
        return f"{typing.get_origin(tp).__name__}[{', '.join(_type_name(a) for a in args)}]"
    return getattr(tp, "__name__", str(tp))
