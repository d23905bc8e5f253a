"""``pyshmckpt demo``: its flags (`options`), its run and report (`run`), the GPT it trains
(`gpt`), the checks of what it restores (`checks`), its shared-memory gauges (`shm_usage`) and its
signal handling (`signals`)."""
