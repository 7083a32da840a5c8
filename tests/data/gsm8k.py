"""Three GSM8K training problems in the layouts users bring: plain jsonl, verl's parquet, TRL's
conversational jsonl; `python -m tests.data.gsm8k` (with `datasets` installed) writes `gsm8k_verl_disk/`,
the verl rows saved with `DatasetDict.save_to_disk` (train: the three rows, test: the first one)."""

from __future__ import annotations

from pathlib import Path

DISK_FIXTURE = Path(__file__).parent / "gsm8k_verl_disk"
# verl's examples/data_preprocess/gsm8k.py appends this to every question
INSTRUCTION = 'Let\'s think step by step and output the final answer after "####".'
PROBLEMS = [
    (
        "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips to her "
        "friends in May. How many clips did Natalia sell altogether in April and May?",
        "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\nNatalia sold 48+24 = <<48+24=72>>72 clips "
        "altogether in April and May.\n#### 72",
    ),
    (
        "Weng earns $12 an hour for babysitting. Yesterday, she just did 50 minutes of babysitting. How "
        "much did she earn?",
        "Weng earns 12/60 = $<<12/60=0.2>>0.2 per minute.\nWorking 50 minutes, she earned 0.2 x 50 = "
        "$<<0.2*50=10>>10.\n#### 10",
    ),
    (
        "Betty is saving money for a new wallet which costs $100. Betty has only half of the money she "
        "needs. Her parents decided to give her $15 for that purpose, and her grandparents twice as much "
        "as her parents. How much more money does Betty need to buy the wallet?",
        "In the beginning, Betty has only 100 / 2 = $<<100/2=50>>50.\nBetty's grandparents gave her 15 * "
        "2 = $<<15*2=30>>30.\nThis means, Betty needs 100 - 50 - 30 - 15 = $<<100-50-30-15=5>>5 more.\n"
        "#### 5",
    ),
]


def question(i: int) -> str:
    return f"{PROBLEMS[i][0]} {INSTRUCTION}"


def solution(i: int) -> str:
    """The number after `####`, as verl's preprocessing extracts it."""
    return PROBLEMS[i][1].split("#### ")[-1].replace(",", "")


def plain_rows() -> list[dict]:
    return [{"prompt": question(i), "answer": solution(i), "id": str(i)} for i in range(len(PROBLEMS))]


def verl_rows(split: str = "train") -> list[dict]:
    """verl's GSM8K layout (examples/data_preprocess/gsm8k.py)."""
    return [
        {
            "data_source": "openai/gsm8k",
            "prompt": [{"role": "user", "content": question(i)}],
            "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": solution(i)},
            "extra_info": {"split": split, "index": i, "answer": a, "question": q},
        }
        for i, (q, a) in enumerate(PROBLEMS)
    ]


def trl_rows() -> list[dict]:
    """TRL's conversational prompt-only layout, the answer in an extra column (GRPO passes it on)."""
    return [
        {"prompt": [{"role": "user", "content": question(i)}], "answer": solution(i)}
        for i in range(len(PROBLEMS))
    ]


if __name__ == "__main__":
    import datasets
    import pyarrow as pa

    def dataset(rows: list[dict], name: str) -> datasets.Dataset:
        # an explicit fingerprint: datasets' own hashing of the table can fail on a mismatched dill
        return datasets.Dataset(datasets.table.InMemoryTable(pa.Table.from_pylist(rows)), fingerprint=name)

    train = dataset(verl_rows("train"), "gsm8k-train")
    test = dataset(verl_rows("test")[:1], "gsm8k-test")
    datasets.DatasetDict({"train": train, "test": test}).save_to_disk(str(DISK_FIXTURE))
    print(f"written with datasets {datasets.__version__}: {DISK_FIXTURE}")
