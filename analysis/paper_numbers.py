"""The paper's published numbers (Tables 1, 2, 3, 8, 9 and Figure 4), to print beside reproduced rows.

Keys: (model config name, bits, method); BF16 rows use method None. The paper's baseline
rows are unprotected and its QuantMLA rows protected (its Table 1 MMLU entries equal Table 3's
unprotected runs), so a reproduced row
is compared with these only under that convention.
"""

from __future__ import annotations

# Table 1 (Suite A): CS, MMLU, GSM8K, FDA, SWDE, SQuAD, Avg
SUITE_A_COLUMNS = ("cs", "mmlu", "gsm8k", "fda", "swde", "squad_completion", "avg")
TABLE1 = {
    ("deepseek_v2_lite", "C16R16", None): (69.76, 57.90, 36.92, 78.13, 89.20, 57.10, 66.80),
    ("deepseek_v2_lite", "C4R4", "rtn"): (67.17, 51.90, 16.98, 65.06, 84.88, 55.50, 61.02),
    ("deepseek_v2_lite", "C4R4", "smoothquant"): (68.23, 54.02, 24.56, 70.69, 87.85, 56.07, 63.44),
    ("deepseek_v2_lite", "C4R4", "quarot"): (69.01, 55.66, 30.71, 72.14, 88.12, 55.06, 64.67),
    ("deepseek_v2_lite", "C4R4", "quantmla"): (69.92, 57.95, 35.25, 77.77, 88.12, 56.70, 66.54),
    ("deepseek_v2_lite", "C2R4", "rtn"): (62.21, 40.91, 3.71, 30.40, 70.75, 44.74, 50.16),
    ("deepseek_v2_lite", "C2R4", "smoothquant"): (65.93, 49.40, 15.31, 45.10, 80.20, 52.51, 57.22),
    ("deepseek_v2_lite", "C2R4", "quarot"): (64.32, 45.92, 12.13, 40.11, 75.52, 46.08, 54.14),
    ("deepseek_v2_lite", "C2R4", "quantmla"): (69.85, 57.29, 37.91, 60.44, 84.52, 54.79, 64.42),
    ("moonlight_16b_a3b", "C16R16", None): (74.32, 69.97, 74.53, 78.40, 90.10, 51.07, 73.57),
    ("moonlight_16b_a3b", "C4R4", "rtn"): (73.94, 67.99, 69.60, 75.59, 90.64, 51.11, 72.46),
    ("moonlight_16b_a3b", "C4R4", "smoothquant"): (73.39, 68.45, 68.99, 77.22, 89.29, 49.87, 72.08),
    ("moonlight_16b_a3b", "C4R4", "quarot"): (74.11, 67.73, 71.87, 74.41, 90.28, 50.20, 72.50),
    ("moonlight_16b_a3b", "C4R4", "quantmla"): (74.24, 69.71, 74.53, 78.77, 89.65, 50.54, 73.44),
    ("moonlight_16b_a3b", "C2R4", "rtn"): (69.78, 60.72, 41.77, 47.01, 82.81, 36.03, 61.72),
    ("moonlight_16b_a3b", "C2R4", "smoothquant"): (64.95, 58.99, 33.81, 61.52, 83.35, 56.23, 61.86),
    ("moonlight_16b_a3b", "C2R4", "quarot"): (62.72, 56.16, 27.37, 25.50, 72.73, 35.36, 53.07),
    ("moonlight_16b_a3b", "C2R4", "quantmla"): (74.22, 69.29, 75.21, 72.50, 88.21, 50.64, 72.70),
}

# Table 8 (the commonsense breakdown of Table 1's CS): HellaSwag, PIQA, ARC-E, ARC-C, WinoGrande, Avg (= CS)
TABLE8_COLUMNS = ("hellaswag", "piqa", "arc_easy", "arc_challenge", "winogrande", "cs")
TABLE8 = {
    ("deepseek_v2_lite", "C16R16", None): (77.76, 79.87, 74.28, 46.16, 70.72, 69.76),
    ("deepseek_v2_lite", "C4R4", "rtn"): (75.20, 78.45, 70.03, 44.71, 67.48, 67.17),
    ("deepseek_v2_lite", "C4R4", "smoothquant"): (75.64, 78.73, 71.97, 44.11, 70.72, 68.23),
    ("deepseek_v2_lite", "C4R4", "quarot"): (76.64, 79.27, 73.86, 45.73, 69.53, 69.01),
    ("deepseek_v2_lite", "C4R4", "quantmla"): (77.84, 80.14, 74.33, 46.50, 70.80, 69.92),
    ("deepseek_v2_lite", "C2R4", "rtn"): (69.69, 75.41, 66.16, 38.14, 61.64, 62.21),
    ("deepseek_v2_lite", "C2R4", "smoothquant"): (73.36, 77.58, 69.82, 42.58, 66.30, 65.93),
    ("deepseek_v2_lite", "C2R4", "quarot"): (72.35, 75.57, 67.72, 41.55, 64.40, 64.32),
    ("deepseek_v2_lite", "C2R4", "quantmla"): (77.82, 80.36, 74.16, 46.42, 70.48, 69.85),
    ("moonlight_16b_a3b", "C16R16", None): (78.28, 80.79, 82.53, 58.02, 71.98, 74.32),
    ("moonlight_16b_a3b", "C4R4", "rtn"): (77.78, 80.90, 83.29, 57.25, 70.48, 73.94),
    ("moonlight_16b_a3b", "C4R4", "smoothquant"): (77.26, 81.01, 81.99, 55.97, 70.72, 73.39),
    ("moonlight_16b_a3b", "C4R4", "quarot"): (78.59, 80.63, 81.82, 57.68, 71.82, 74.11),
    ("moonlight_16b_a3b", "C4R4", "quantmla"): (78.34, 80.58, 82.58, 58.28, 71.43, 74.24),
    ("moonlight_16b_a3b", "C2R4", "rtn"): (74.21, 77.97, 77.99, 50.68, 68.03, 69.78),
    ("moonlight_16b_a3b", "C2R4", "smoothquant"): (70.69, 75.90, 68.43, 45.31, 64.40, 64.95),
    ("moonlight_16b_a3b", "C2R4", "quarot"): (67.37, 75.52, 67.63, 42.24, 60.85, 62.72),
    ("moonlight_16b_a3b", "C2R4", "quantmla"): (78.32, 80.85, 82.41, 57.94, 71.59, 74.22),
}

# Table 2 (Suite B): GPQA-D, MMLU, GSM8K, MATH500, AIME25, HumanEval, LiveCodeBench, Avg
SUITE_B_COLUMNS = (
    "gpqa_diamond_zeroshot",
    "mmlu",
    "gsm8k",
    "minerva_math500",
    "aime25",
    "humaneval",
    "livecodebench",
    "avg",
)
TABLE2 = {
    ("longcat_flash_lite", "C16R16", None): (46.46, 80.77, 71.72, 57.40, 70.00, 73.78, 49.67, 64.26),
    ("longcat_flash_lite", "C4R4", "rtn"): (42.42, 76.38, 68.01, 48.00, 40.00, 39.02, 32.70, 49.50),
    ("longcat_flash_lite", "C4R4", "smoothquant"): (42.42, 78.49, 69.75, 53.20, 53.33, 60.37, 42.75, 57.19),
    ("longcat_flash_lite", "C4R4", "quarot"): (39.90, 78.52, 64.67, 54.40, 56.67, 56.71, 42.65, 56.22),
    ("longcat_flash_lite", "C4R4", "quantmla"): (44.95, 80.51, 69.75, 54.80, 63.33, 71.34, 49.38, 62.01),
    ("longcat_flash_lite", "C2R4", "rtn"): (29.29, 70.72, 50.95, 39.20, 26.67, 27.44, 24.27, 38.36),
    ("longcat_flash_lite", "C2R4", "smoothquant"): (33.84, 74.55, 57.62, 47.00, 33.33, 39.63, 29.57, 45.08),
    ("longcat_flash_lite", "C2R4", "quarot"): (28.28, 64.27, 30.02, 24.80, 6.67, 35.98, 16.78, 29.54),
    ("longcat_flash_lite", "C2R4", "quantmla"): (44.95, 80.57, 68.84, 56.80, 60.00, 71.34, 49.00, 61.64),
    ("glm_4_7_flash", "C16R16", None): (42.93, 72.09, 83.85, 56.40, 63.33, 36.59, 32.04, 55.32),
    ("glm_4_7_flash", "C4R4", "rtn"): (37.88, 70.79, 81.27, 51.20, 56.67, 29.88, 29.67, 51.05),
    ("glm_4_7_flash", "C4R4", "smoothquant"): (36.87, 70.60, 81.12, 51.00, 53.33, 31.71, 31.47, 50.87),
    ("glm_4_7_flash", "C4R4", "quarot"): (34.85, 70.84, 82.41, 52.80, 46.67, 28.66, 30.62, 49.55),
    ("glm_4_7_flash", "C4R4", "quantmla"): (38.89, 71.95, 83.70, 57.40, 56.67, 34.76, 32.89, 53.75),
    ("glm_4_7_flash", "C2R4", "rtn"): (30.81, 64.81, 71.19, 42.40, 36.67, 31.71, 21.80, 42.77),
    ("glm_4_7_flash", "C2R4", "smoothquant"): (31.82, 64.48, 73.62, 45.40, 46.67, 29.27, 25.21, 45.21),
    ("glm_4_7_flash", "C2R4", "quarot"): (28.79, 53.64, 51.10, 34.20, 26.67, 6.10, 18.10, 31.23),
    ("glm_4_7_flash", "C2R4", "quantmla"): (39.39, 71.50, 82.94, 55.00, 46.67, 34.15, 30.33, 51.43),
}

# RULER on DeepSeek-V2-Lite at C4R4, QuantMLA, mean over 4K-32K (Figure 4; only the values its text gives)
RULER_QUANTMLA = {"niah_single_1": 99.95, "niah_single_2": 99.60, "niah_single_3": 87.20}

# Table 3: DeepSeek-V2-Lite MMLU 5-shot at C4R4
TABLE3 = {
    "BF16": 57.90,
    "RTN": 51.90,
    "SmoothQuant†": 54.02,
    "QuaRot†": 55.66,
    "+ content-path transform": 53.12,
    "+ RoPE-path transform": 56.31,
    "+ BF16 protection (full QuantMLA)": 57.95,
}


# Table 9 (App. F.1, µs): decode latency, 16 heads, one query token, C4R4 with sink 4 + recent 128
# against a BF16 cache, on a 78-SM Hopper GPU with 78 scheduling partitions. (batch, N): (BF16, C4R4, Δ %)
TABLE9 = {
    (8, 1 << 10): (25.69, 23.78, -7.42),
    (8, 1 << 12): (51.43, 53.63, 4.29),
    (8, 1 << 13): (82.50, 85.35, 3.45),
    (8, 1 << 14): (147.34, 149.79, 1.66),
    (8, 1 << 15): (281.44, 281.99, 0.20),
    (8, 1 << 16): (542.14, 540.61, -0.28),
    (8, 1 << 17): (1067.24, 1062.32, -0.46),
    (8, 1 << 18): (2122.10, 2113.33, -0.41),
    (8, 1 << 19): (4234.79, 4214.84, -0.47),
    (8, 1 << 20): (8440.05, 8418.63, -0.25),
    (32, 1 << 10): (55.50, 56.97, 2.64),
    (32, 1 << 12): (156.82, 155.54, -0.82),
    (32, 1 << 13): (287.58, 283.46, -1.43),
    (32, 1 << 14): (548.73, 547.20, -0.28),
    (32, 1 << 15): (1072.93, 1067.28, -0.53),
    (32, 1 << 16): (2133.71, 2124.10, -0.45),
    (32, 1 << 17): (4236.96, 4225.35, -0.27),
    (32, 1 << 18): (8449.30, 8426.35, -0.27),
    (32, 1 << 19): (16880.19, 16827.11, -0.31),
    (32, 1 << 20): (33701.48, 33609.17, -0.27),
}


def context_label(n: int) -> str:
    """1024 → "1K", 1048576 → "1M" (Table 9's context column)."""
    return f"{n >> 20}M" if n >= 1 << 20 else f"{n >> 10}K"


# The model whose numbers stand beside a reproduction on a model the paper does not report (its
# main model: the only one of Table 3 and Figure 4)
REFERENCE = "deepseek_v2_lite"


def paper_model(table: dict, model: str) -> str:
    """``model`` where ``table`` reports it, else the paper's reference model."""
    return model if any(k[0] == model for k in table) else REFERENCE


def paper_row(table: dict, model: str, bits: str, method: str, protect: bool):
    """The paper's numbers for a reproduced row (the reference model's for a model the paper does not
    report, :func:`paper_model`), or None if the paper has no such row."""
    model = paper_model(table, model)
    if bits == "C16R16":
        return table.get((model, bits, None))
    if protect != (method == "quantmla"):
        return None
    return table.get((model, bits, method))
