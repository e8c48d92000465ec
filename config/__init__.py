"""The run configuration: the schema (schema.py, one tree of dataclasses, every field a flag), the
command line and config files (cli.py, files.py), the checks that need no process group
(preflight.py: every range once, every file the run reads) and validation into the facts every
role reads (validate.py: RunFacts, decided once).

May import checkpointing/, prompts/, parallel/, models/, rewards/ and rl/; never a role or runtime/."""
