"""Classification: softmax over logits (or as the card says), top-k, and 'uncertain' below the card's top-1
threshold."""

from __future__ import annotations

import numpy as np

from worker.runtime.model_output import ModelOutput, one_array
from worker.tasks.results import Classification
from worker.tasks import OtherOutputs, activate, check_labels
from worker.tasks.preprocess import CardPreprocessing, Geometry


class Classifier(CardPreprocessing):
    def check_output(self, output: ModelOutput, others: OtherOutputs = ()) -> None:
        output = one_array(output, self.card.name)
        check_labels(self.card, output.size, output)  # (C,), or (C, 1, 1) as some exports give: raveled

    def postprocess(self, output: ModelOutput, geometry: Geometry) -> Classification:
        """output: (C,) logits for one image (probabilities with `activation: none`, independent
        per-class logits with `sigmoid`)."""
        output = one_array(output, self.card.name)
        probs = activate(output.astype(np.float64).ravel(), self.card.postprocess.activation or "softmax")
        k = min(self.card.postprocess.top_k, probs.size)
        top = np.argsort(-probs, kind="stable")[:k]
        return Classification(class_ids=top.astype(np.int64), scores=probs[top],
                              names=tuple(self.card.label(int(i)) for i in top),
                              uncertain=bool(probs[top[0]] < self.card.postprocess.threshold))
