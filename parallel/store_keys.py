"""Every key the run writes on torchrun's rendezvous store, in one place: the store is a protocol
between ranks, and this module is its registry. Each function names one key family; the table says
who writes it, who reads it and when it goes. Keys are relative to `StepStore`'s prefix (digenrl/).

| family | key | written by | read by | deleted |
|---|---|---|---|---|
| step record | rec/{step}/{rank} | every rank after its step (runtime/steplog.py) | the logging rank | by the logging rank once read |
| running std | std/{step} | the logging rank (steplog), a resume (checkpointing/resume.py) | generators scoring step+1 (runtime/build.py), a resume | 3 steps later, by the logging rank |
| fragment record | adv/{step}/{fragment} | whoever scored the fragment (parallel/fragment_records.py) | every trainer at the step's end | by one trainer, once all have read |
| trainer began | begin/{step}/{rank} | a trainer starting its step (runtime/build.py) | generators before sending to it (runtime/steps.py) | never: one byte a step |
| version published | pub/{version} | the first trainer after an update (runtime/steps.py), a resume | TCSS generators (rollout.py VersionSync) | never: one byte a step |
| replica version | rv/{replica}/{step} | a GAP replica's stage 0 | its other stages (rollout.py) | never: one byte a step |
| TAG claims | claim/{step} | a counter every claimant adds to (parallel/tag.py) | the claimants | never |
| fragment owner | owner/{step}/{fragment} | the claimant | trainers waiting for the fragment | never |
| replica busy | busy/{step}/{replica} | a replica starting a claimed fragment | BTS on the trainers | never |
| fragment landed | landed/{step}/{fragment} | the trainer that took the fragment | BTS on the trainers | never |
| replica cost | cost/replica/{replica} | a replica after a fragment | BTS on the trainers | overwritten |
| GAP round | round/{step}/{replica}/{n} | a GAP replica's stage 0 under TAG | its other stages | never |
| FSDP TAG decision | tagdec/{step}/{slot}/{n} | the first FSDP trainer | the other FSDP trainers | by the first trainer, next step |
| run record | run/record | rank 0 at start-up (runtime/build.py) | every rank | never |
| placement decision | placement/decision/{step} | the logging rank at a --placement auto trial's end (runtime/autoplace.py) | every rank | never: one per trial |
| period across a switch | placement/previous_end/{step} | the logging rank before a placement switch | the new placement's logging rank | never: one per switch |
| rank exited | exit/{rank} | every rank at its end (runtime/build.py) | every rank before leaving | never |
| heartbeat | guard/hb/{rank} | every rank's guard thread, every second | every rank's guard | overwritten |
| rank done | guard/done/{rank} | a rank leaving the loop | the guards (a done rank is not silent) | never |
| step began | guard/began/{rank} | every rank at each step | the rank that stops the run | overwritten |
| stop request | guard/stop/request, guard/stop/at, guard/stop/claim | the first rank signalled | every rank between steps | never |
| fault | guard/fault, guard/fault_claim | the first rank that failed | every other rank | never |

"Never" is a few bytes a step on the store's host, for the length of the run (the store goes with
torchrun). The launch id (parallel/store.py `launch_id`) is written before the prefix exists and is
not a step's key.
"""
from __future__ import annotations


def step_record(step: int, rank: int) -> str:
    return f"rec/{step}/{rank}"


def running_std(step: int) -> str:
    return f"std/{step}"


def fragment_record(step: int, fragment: int) -> str:
    return f"adv/{step}/{fragment}"


def trainer_began(step: int, rank: int) -> str:
    return f"begin/{step}/{rank}"


def version_published(version: int) -> str:
    return f"pub/{version}"


def replica_version(replica: int, step: int) -> str:
    return f"rv/{replica}/{step}"


def claims(step: int) -> str:
    return f"claim/{step}"


def fragment_owner(step: int, fragment: int) -> str:
    return f"owner/{step}/{fragment}"


def replica_busy(step: int, replica: int) -> str:
    return f"busy/{step}/{replica}"


def fragment_landed(step: int, fragment: int) -> str:
    return f"landed/{step}/{fragment}"


def replica_cost(replica: int) -> str:
    return f"cost/replica/{replica}"


def gap_round(step: int, replica: int, n: int) -> str:
    return f"round/{step}/{replica}/{n}"


def tag_decision(step: int, slot: int, n: int) -> str:
    return f"tagdec/{step}/{slot}/{n}"


RUN_RECORD = "run/record"


def placement_decision(step: int) -> str:
    return f"placement/decision/{step}"


def previous_end(step: int) -> str:
    return f"placement/previous_end/{step}"


def rank_exited(rank: int) -> str:
    return f"exit/{rank}"


def heartbeat(rank: int) -> str:
    return f"guard/hb/{rank}"


def rank_done(rank: int) -> str:
    return f"guard/done/{rank}"


def step_began(rank: int) -> str:
    return f"guard/began/{rank}"


STOP_REQUEST = "guard/stop/request"
STOP_AT = "guard/stop/at"
STOP_CLAIM = "guard/stop/claim"
FAULT = "guard/fault"
FAULT_CLAIM = "guard/fault_claim"

FAMILIES = ("rec", "std", "adv", "begin", "pub", "rv", "claim", "owner", "busy", "landed", "cost", "round",
            "tagdec", "run", "placement", "exit", "guard")
"""the first part of every key: a string starting with one of these and a slash, anywhere else in the
run's code, is a key written around this registry (tests/test_architecture.py)"""
