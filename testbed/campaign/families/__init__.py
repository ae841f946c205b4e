"""Method families on the controller, one module each: HAT's drafting (``draft``), Andes' serving engine
(``serving``), DiSCo's dispatch (``dispatch``), LLMS' context service (``context_service``) and
CoCoServe's GPU ranks (``scaling``). A family's module holds everything the controller knows of it:

- the section a campaign writes (its pydantic model, with the fields, defaults and limits of the run
  contract's section in ``nodes/contracts/run_config.py`` where the nodes read one);
- which methods read it (:meth:`MethodFamily.applies`, from the method's traits) and whether a section
  written for another method is refused;
- its translation into the run config's section (:meth:`MethodFamily.run_section`) and the devices'
  schedules when the family makes its own (:meth:`MethodFamily.schedules`);
- its checks against the lab before any node is touched, and the settings a run leaves unread.

``spec.RunSettings`` takes one optional field per registered family; ``run_spec`` and ``validation`` ask
the registry, never a family by name. A new family is a module here (listed in ``_modules``) or a lab's
own module named by ``TESTBED_METHOD_FAMILIES`` that calls :func:`register`, and its methods in
``nodes/contracts/methods``.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

from pydantic import BaseModel

from foundation.lab_modules import import_lab_modules
from foundation.user_fields import STRICT_MODEL_CONFIG
from nodes.contracts.methods import Method, method_named
from nodes.contracts.methods import names as method_names

if TYPE_CHECKING:
    from testbed.inventory import Inventory

Problem = tuple[str, str, str]  # (dotted field, what is wrong, how to fix it)


class SectionModel(BaseModel):
    """A family's section as a campaign writes it: unknown keys are errors, values frozen."""

    model_config = STRICT_MODEL_CONFIG


class FamilyContext(NamedTuple):
    """What a family's translation and checks see of the campaign: its lab, and the folder its file
    is in (paths in the campaign are relative to it)."""

    inventory: Inventory
    base_dir: Path

    def resolve(self, written: str) -> Path:
        path = Path(written).expanduser()
        return path if path.is_absolute() else (self.base_dir / path).resolve()

    def has_nodes(self, names: Iterable[str]) -> bool:
        """Whether every name is a node, a group or ``all`` of the lab (else validation reports it)."""
        known = {n.name for n in self.inventory.nodes} | set(self.inventory.groups) | {"all"}
        return set(names) <= known


class MethodFamily:
    """One family: override what it has (see the module docstring)."""

    section = ""  # the key under a run's settings, and the run config's section of the same name
    settings_model: type[SectionModel] = SectionModel
    summary = ""  # what the section is, in words (a refusal names it)
    default_written = False  # the section is there (with its defaults) when the campaign leaves it out
    refuse_elsewhere = True  # a section written for a method the family does not apply to is an error

    def applies(self, method: Method) -> bool:
        """Whether ``method`` reads the section."""
        raise NotImplementedError

    def elsewhere(self, method_name: str) -> str:
        """Why the section is refused for ``method_name``, with the fix: the methods that read it."""
        readers = [name for name in method_names() if self.applies(method_named(name))]
        return (f"{self.section}: {method_name} does not read it (it is {self.summary}); use method: "
                f"{', '.join(readers) or 'none registered'}, or remove the {self.section} section")  # fmt: skip

    def reads(self, settings: Any) -> bool:
        """Whether the run's method reads the section."""
        return self.applies(method_named(settings.method))

    def settings_of(self, settings: Any) -> Any:
        """The run's section, or the family's defaults when the campaign did not write one."""
        value = getattr(settings, self.section)
        return value if value is not None else self.settings_model()

    def in_run_config(self, settings: Any) -> bool:
        """Whether the run's config gets the section (by default: when the run's method reads it)."""
        return self.reads(settings)

    def run_section(self, context: FamilyContext, settings: Any) -> Mapping[str, Any] | None:
        """The run config's section for ``settings`` (None: the nodes read no section of this family)."""
        return None

    def schedules(
        self, context: FamilyContext, settings: Any, devices: tuple[str, ...], seed: int
    ) -> dict[str, list[dict[str, Any]]] | None:
        """Each device's schedule rows when the family makes its own (None: the workload's)."""
        return None

    def problems(self, context: FamilyContext, settings: Any) -> Iterable[Problem]:
        """What is wrong with the section against the lab, found before any node is touched."""
        return ()

    def ignored(self, settings: Any) -> dict[str, str]:
        """The section's settings (dotted paths) this run does not read, each with the reason."""
        return {}


def _modules() -> tuple[Any, ...]:
    from testbed.campaign.families import andes, cocoserve, disco, hat, llms

    return (hat, andes, disco, llms, cocoserve)


_REGISTRY: dict[str, MethodFamily] = {}
LAB_FAMILIES_VARIABLE = "TESTBED_METHOD_FAMILIES"  # a lab's modules that register families of their own


def register(family: MethodFamily) -> MethodFamily:
    """Add ``family`` (a section may be registered once: a lab's never replaces a built-in one)."""
    families()
    if not family.section or family.section in _REGISTRY:
        raise ValueError(f"a method family needs a section not registered yet, not {family.section!r}")
    _REGISTRY[family.section] = family
    return family


def families() -> tuple[MethodFamily, ...]:
    """The registered families: the built-in ones, then a lab's (``TESTBED_METHOD_FAMILIES``)."""
    if not _REGISTRY:
        for module in _modules():
            _REGISTRY[module.FAMILY.section] = module.FAMILY
        import_lab_modules(LAB_FAMILIES_VARIABLE, "method families")
    return tuple(_REGISTRY.values())


def family_named(section: str) -> MethodFamily:
    families()
    return _REGISTRY[section]


__all__ = ["FamilyContext", "MethodFamily", "Problem", "SectionModel", "families", "family_named", "register"]
