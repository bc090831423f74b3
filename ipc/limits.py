"""The scheduler's hard limits that options are checked against, as plain numbers: the CLI and
EngineConfig read them without importing the layout (numpy)."""

# batch slots: rl_emit_events packs a slot's token and done counts into one word, 16 bits each
MAX_SLOTS = (1 << 16) - 1
