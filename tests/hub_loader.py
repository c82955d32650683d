"""Run in a fresh interpreter by the Hub-folder tests: load exported folders without mnemo.

Usage: ``python hub_loader.py JOB.json RESULT.pt``. The job lists models to load
(a folder path, or a Hub id resolved from the offline cache), inputs to run, and
optionally a LoRA adapter to put on top, a pipeline to build, PEFT's default LoRA
targets to apply (``lora_defaults``: an adapter folder to save them to) or a folder to
save the loaded model to and load again (``resave``). Importing mnemo is made
impossible first, so everything must come from the folders' own files.
"""

from __future__ import annotations

import importlib.abc
import json
import sys


class _BlockMnemo(importlib.abc.MetaPathFinder):
    def find_spec(self, name, _path=None, _target=None):
        if name == "mnemo" or name.startswith("mnemo."):
            raise ImportError(f"{name} is blocked: Hub folders must not need mnemo")
        return None


sys.meta_path.insert(0, _BlockMnemo())


def main(job_path: str, result_path: str) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    with open(job_path, encoding="utf-8") as f:
        job = json.load(f)
    torch.set_num_threads(job["threads"])
    try:
        import mnemo  # noqa: F401
    except ImportError:
        pass
    else:
        raise SystemExit("mnemo is importable: the test would prove nothing")

    results = {}
    for entry in job["models"]:
        model = AutoModelForCausalLM.from_pretrained(entry["source"], trust_remote_code=True).eval()
        out = {"class_module": type(model).__module__}
        if entry.get("adapter"):
            from peft import PeftModel

            model = PeftModel.from_pretrained(model, entry["adapter"]).eval()
        ids = torch.tensor(entry["input_ids"])
        mask = torch.tensor(entry["attention_mask"])
        with torch.no_grad():
            out["logits"] = model(input_ids=ids, attention_mask=mask).logits
            out["generated"] = model.generate(
                input_ids=ids, attention_mask=mask, max_new_tokens=entry["max_new_tokens"], do_sample=False
            )
            if entry.get("cuda_graph"):  # the exported code's fixed-buffer decode step (eager off CUDA)
                out["generated_graph"] = model.generate(
                    input_ids=ids, attention_mask=mask, max_new_tokens=entry["max_new_tokens"], do_sample=False,
                    cuda_graph=True,
                )
        if entry.get("resave"):  # a model of the exported classes writes a folder that loads the same way
            model.save_pretrained(entry["resave"])
            again = AutoModelForCausalLM.from_pretrained(entry["resave"], trust_remote_code=True).eval()
            with torch.no_grad():
                out["resaved_logits"] = again(input_ids=ids, attention_mask=mask).logits
        if entry.get("lora_defaults"):  # no target_modules: the exported code registered the family's
            from peft import LoraConfig, get_peft_model

            lora = get_peft_model(model, LoraConfig(task_type="CAUSAL_LM", r=2))
            lora.save_pretrained(entry["lora_defaults"])
            out["lora_modules"] = sorted({name for name, module in lora.named_modules() if hasattr(module, "lora_A")})
            with torch.no_grad():
                out["lora_logits"] = lora(input_ids=ids, attention_mask=mask).logits
        if entry.get("pipeline_prompt"):
            from transformers import pipeline

            generator = pipeline("text-generation", model=entry["source"], trust_remote_code=True)
            out["pipeline_text"] = generator(
                entry["pipeline_prompt"], max_new_tokens=entry["max_new_tokens"], do_sample=False
            )[0]["generated_text"]
        results[entry["name"]] = out
    assert not any(name == "mnemo" or name.startswith("mnemo.") for name in sys.modules)
    torch.save(results, result_path)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
