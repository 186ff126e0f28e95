"""ReCo: reward-coordinated compression and stopping (the self-contained parts).

ReCo ("reward-coordinated compression", arXiv) couples three decoding-time controls of a long
chain-of-thought to one step-level process-reward estimate:

1. **compression strength**: the KV budget of the next compression event shrinks as the reward of the
   latest reasoning step grows (a confident trajectory can afford a harder squeeze; a shaky one keeps
   more context) -> `RewardBudgetSchedule`;
2. **reflection penalty**: logits of reflection tokens ("wait", "hmm", "alternatively", ...) are lowered
   by an amount banded by reward, to curb redundant re-checking when the model is already confident
   -> `ReflectionPenalty`;
3. **confidence early stopping**: decoding stops (or is steered into a final answer) once the last `k`
   steps are all confident -> `ConfidenceStopping` + `ForcePrefix`.

Only the paper's abstract was available; there is no reference code. Everything below (the step
segmentation rules, the no-training confidence proxy, the linear budget schedule, the band semantics,
the stop/force protocol) is **our design**, documented at each class.

How the pieces talk during `model.generate` (greedy or sampling; beam search is not supported):

* `RewardTracker` is the shared state. It is fed by a logits processor: at each decoding step the
  processor hands it `(input_ids, scores)`. The tracker first ingests the token(s) appended since the
  last call (their log-probability and the entropy come from the distribution it saw at the previous
  call), decodes them incrementally, segments the text into steps with a `StepSegmenter`, and scores
  every step that just completed with a `StepReward`. Then it stores the new distribution for the token
  about to be sampled.
* Which processor feeds it: `RewardTrackingProcessor` (observe-only, returns the scores unchanged) is the
  intended feeder; put it FIRST in your `LogitsProcessorList` so it sees the model's logits before any
  penalty. `ReflectionPenalty` also feeds the tracker (`update_tracker=True`), so it works on its own;
  feeding is idempotent per sequence length, so whichever ReCo processor runs first in a step wins and
  the rest are no-ops. (In transformers 5 user processors run after the built-in ones such as the
  repetition penalty, and before the sampling warpers temperature/top-k/top-p.)
* `ConfidenceStopping` runs after the new token is appended; it calls `tracker.sync(input_ids)` so the
  step that this very token completed is scored before the stop decision. Stopping is therefore exact:
  it fires on the call where the criterion first holds.

Batch: every object keeps per-row state (row b of `input_ids`); `B > 1` works, each row is segmented and
rewarded on its own.

Step-attributed eviction (`eviction`): tokens carry their step in a token-state channel
(`StepRewardScore`) and the tokens of the highest-reward completed steps are evicted first
(`kvcompose.methods.reco_evict`); `StepReplay` replays a tracker along a fixed trace for teacher forcing.

Modules: `segment` (step segmentation), `rewards` (step rewards), `tracker` (`RewardTracker`, budget
schedule), `processors` (logits processors), `stopping` (`ConfidenceStopping`), `eviction`
(`StepRewardScore`, `Lexicographic`, `StepReplay`). Every public name is
re-exported here, so `from kvcompose.reco import X` works for all of them.
"""

from .processors import (
    DEFAULT_PENALTY_BANDS,
    DEFAULT_REFLECTION_WORDS,
    ForcePrefix,
    ReflectionPenalty,
    RewardTrackingProcessor,
)
from .rewards import ConfidenceReward, PRMReward, StepInfo, StepReward
from .segment import (
    BLANK_LINES,
    DEFAULT_ABBREVIATIONS,
    DEFAULT_DELIMITERS,
    Boundary,
    CompletedStep,
    StepSegmenter,
    StepStream,
    split_steps,
    step_marker,
)
from .eviction import UNREWARDED, Lexicographic, StepReplay, StepRewardScore, StepSource
from .stopping import DEFAULT_ANSWER_PATTERN, ConfidenceStopping
from .tracker import RewardBudgetSchedule, RewardTracker, reward_to_budget

__all__ = [
    "Boundary",
    "BLANK_LINES",
    "step_marker",
    "DEFAULT_DELIMITERS",
    "DEFAULT_ABBREVIATIONS",
    "StepSegmenter",
    "StepStream",
    "CompletedStep",
    "split_steps",
    "StepInfo",
    "StepReward",
    "ConfidenceReward",
    "PRMReward",
    "RewardTracker",
    "RewardTrackingProcessor",
    "RewardBudgetSchedule",
    "reward_to_budget",
    "DEFAULT_REFLECTION_WORDS",
    "DEFAULT_PENALTY_BANDS",
    "ReflectionPenalty",
    "DEFAULT_ANSWER_PATTERN",
    "ForcePrefix",
    "ConfidenceStopping",
    "StepSource",
    "StepRewardScore",
    "Lexicographic",
    "StepReplay",
    "UNREWARDED",
]
