"""Update rules: the protocol the engine codes against (:mod:`.protocol`), the registry that finds a rule by name
(:mod:`.registry`), AdamW (:mod:`.adamw`, registered as "adamw" on import of this package), and the math of the
state's encodings (remainders, int8 maps)."""

from . import muon as _muon  # noqa: F401, I001  (registers "muon"; first, so the registry's order is unchanged)
from . import adamw as _adamw  # noqa: F401  (registers "adamw")
