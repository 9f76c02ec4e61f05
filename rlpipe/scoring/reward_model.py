"""Reward models, TRL's contract: an entry of reward.functions that names a folder or a Hugging Face Hub id of a
sequence-classification model (one label; rlpipe/rewards/specs.py says which names do) is scored by that model, as
TRL's GRPOTrainer scores a model given in `reward_funcs`:

- where the prompts are conversations, each sample is the prompt's messages followed by the completion's, rendered by
  the reward model's own chat template (`apply_chat_template(..., tokenize=False)`); plain-text prompts are joined to
  their completions as they are;
- the texts are tokenized by the reward model's tokenizer without special tokens, padded on the right with its pad
  token (its end-of-sequence token where it has none), and the score is the model's single logit at the last token
  that is not padding;
- one difference, on purpose: a special token's text inside a message (a completion that writes `<|im_end|>`) is
  tokenized as text, not as the marker, so the policy cannot end its turn and write another for the reward model
  to read. Samples without such text get TRL's ids exactly.

The model runs in the scorer role's actors (actors/scorer.py), never in the reward functions' process; its weights
are read from safetensors only, and no code from its folder runs.
"""

from __future__ import annotations

import json
from pathlib import Path

from rlpipe.config import ConfigError, one_line
from rlpipe.data.templating import kept_contents, templated_ids
from rlpipe.usercode.callables import RewardConfigError

SEQUENCE_CLASSIFICATION = "ForSequenceClassification"
# The names transformers gives a sequence-classification head's weight (decoders: score; encoders: classifier).
HEAD_WEIGHTS = ("score.weight", "classifier.weight", "classifier.out_proj.weight")


def model_folder(name: str, where: str) -> str:
    """The local folder of model `name`, named as model.path names one (a folder, `builtin:NAME`, a Hub id fetched
    into the Hugging Face cache); raises a one-line RewardConfigError naming `where`."""
    from rlpipe.models.builtin import resolve_model_path

    try:
        folder = Path(resolve_model_path(str(Path(name).expanduser()) if "/" in name else name, key=where))
    except ConfigError as err:
        raise RewardConfigError(str(err)) from None
    if not folder.is_dir():
        raise RewardConfigError(f"{where}: {name} is neither a folder nor a Hugging Face Hub id (org/name)")
    return str(folder.resolve())


def check_reward_model(folder: str, where: str) -> None:
    """Refuse, in one line naming `where`, a folder that is not a one-label sequence-classification model whose
    weights are safetensors: its files inside it, its config naming a *ForSequenceClassification architecture (any
    other model's score head would be untrained), one label, and a tokenizer it can be loaded with."""
    from rlpipe.models.checks import ModelFileError, check_links, stored_tensors

    try:
        check_links(folder)
        config = json.loads((Path(folder) / "config.json").read_text())
        tensors = stored_tensors(folder)
    except ModelFileError as err:
        raise RewardConfigError(f"{where}: {err}") from None
    except (OSError, ValueError) as err:
        raise RewardConfigError(f"{where}: {folder} has no readable config.json ({err})") from None
    architectures = config.get("architectures") if isinstance(config, dict) else None
    if not isinstance(architectures, list) or not any(
        isinstance(a, str) and a.endswith(SEQUENCE_CLASSIFICATION) for a in architectures
    ):
        raise RewardConfigError(
            f"{where}: {folder} is a {', '.join(map(str, architectures or ['?']))} model, not a "
            f"sequence-classification reward model (its config.json must list a *{SEQUENCE_CLASSIFICATION} architecture)"
        )
    labels = config.get("id2label")
    heads = {name: tensor.shape for name, tensor in tensors.items() if name.endswith(HEAD_WEIGHTS)}
    rows = {shape[0] for shape in heads.values() if shape}
    if (isinstance(labels, dict) and len(labels) != 1) or rows - {1}:
        count = len(labels) if isinstance(labels, dict) and len(labels) != 1 else max(rows)
        raise RewardConfigError(
            f"{where}: {folder} is a classifier of {count} labels; a reward model gives one score (num_labels 1)"
        )
    checked_tokenizer(folder, where)


def checked_tokenizer(folder: str, where: str):
    """The tokenizer of a scorer's model folder; one that does not load is refused in one line naming `where`."""
    try:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(folder)
    except Exception as err:  # transformers raises several types, with multi-line messages
        raise RewardConfigError(f"{where}: cannot load a tokenizer from {folder}: {one_line(err)}") from None


class RewardModel:
    """One reward model, loaded for scoring (`score`): `batch_size` samples per forward pass, in `dtype`."""

    def __init__(self, folder: str, dtype: str = "float32", batch_size: int = 8):
        import torch
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        self.batch_size = batch_size
        self.tokenizer = AutoTokenizer.from_pretrained(folder)
        if self.tokenizer.pad_token_id is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        self.model = AutoModelForSequenceClassification.from_pretrained(
            folder, num_labels=1, dtype=getattr(torch, dtype), use_safetensors=True, trust_remote_code=False
        ).eval()
        # The model reads its score at the last token that is not the pad token: the tokenizer's.
        self.model.config.get_text_config().pad_token_id = self.tokenizer.pad_token_id
        self.max_length = getattr(self.model.config.get_text_config(), "max_position_embeddings", None)

    def ids(self, prompt, completion) -> list[int]:
        """One sample's token ids as the model reads it (TRL's rendering, see the module's docstring); the texts of
        the messages (the dataset's, the policy's) stay text, so that a special token's text the policy writes cannot
        end a turn or forge one (`rlpipe.data.templating`). Where no text touches a special token, these are the ids
        TRL gives."""
        if isinstance(prompt, list):
            if not self.tokenizer.chat_template:
                raise ValueError("the reward model's tokenizer has no chat template to render the conversations with")
            return templated_ids(self.tokenizer, lambda keep: self.tokenizer.apply_chat_template(
                kept_contents(prompt + completion, keep), tokenize=False))
        return templated_ids(self.tokenizer, lambda keep: keep(prompt) + keep(completion))

    def score(self, prompts: list, completions: list, columns: dict | None = None) -> list[float | None]:
        """One score per sample; None for a sample longer than the model's positions (left unscored). A reward model
        reads no column."""
        import torch

        ids = [self.ids(prompt, completion) for prompt, completion in zip(prompts, completions, strict=True)]
        fits = [i for i, row in enumerate(ids) if self.max_length is None or len(row) <= self.max_length]
        fits.sort(key=lambda i: len(ids[i]))  # neighbours of similar length: less padding per batch
        scores: list[float | None] = [None] * len(ids)
        pad = self.tokenizer.pad_token_id
        for start in range(0, len(fits), self.batch_size):
            chunk = fits[start:start + self.batch_size]
            width = max(len(ids[i]) for i in chunk)
            input_ids = torch.tensor([ids[i] + [pad] * (width - len(ids[i])) for i in chunk])
            mask = torch.tensor([[1] * len(ids[i]) + [0] * (width - len(ids[i])) for i in chunk])
            with torch.inference_mode():
                logits = self.model(input_ids=input_ids, attention_mask=mask).logits[:, 0].float()
            for index, value in zip(chunk, logits.tolist()):
                scores[index] = value
        return scores
