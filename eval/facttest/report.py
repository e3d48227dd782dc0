"""Plain-text table of a ``run_facttest`` result (shared by the CLI and the benchmark)."""

from __future__ import annotations


def format_table(res: dict) -> str:
    sets = res["sets"]
    lines = [
        f"calibration: {res['n_cal']} questions, accuracy {res['accuracy_cal']:.3f}, "
        f"n0 = {res['n0']} incorrect; "
        f"delta {res['delta']}, judge '{res['judge']}'"
    ]
    lines += [
        f"{k}: {v['n']} questions, accuracy when always answering {v['accuracy_all']:.3f}"
        for k, v in sets.items()
    ]
    has_shift = "shifted" in sets
    head = (
        f"{'score':>5} {'alpha':>5} {'k_hat':>5} {'tau':>8} | "
        f"{'TypeI':>6} {'abst':>5} {'acc_ans':>7}"
    )
    if has_shift:
        head += (
            f" | {'TypeI_sh':>8} {'acc_ans_sh':>10} | {'TypeI_cs':>8} {'n0_cs':>5} {'abst_cs':>7}"
        )
    lines.append(head)
    for name, per in res["scores"].items():
        for alpha, row in per.items():
            thr, t = row["threshold"], row["test"]
            tau = "inf" if thr["tau"] is None else f"{thr['tau']:.3f}"
            line = (
                f"{name:>5} {alpha:>5} {str(thr['k_hat']):>5} {tau:>8} | {t['type1']:>6.3f} "
                f"{t['abstention']:>5.2f} {t['accuracy_answered']:>7.3f}"
            )
            if has_shift:
                s, c = row["shifted"], row.get("shifted_cs")
                line += f" | {s['type1']:>8.3f} {s['accuracy_answered']:>10.3f}"
                if c:
                    line += f" | {c['type1']:>8.3f} {c['n0_accepted']:>5} {c['abstention']:>7.2f}"
            lines.append(line)
        if any(row["threshold"]["always_abstain"] for row in per.values()):
            lines.append(
                f"      ({name}: "
                + "; ".join(
                    row["threshold"]["reason"]
                    for row in per.values()
                    if row["threshold"]["always_abstain"]
                )
                + ")"
            )
    lines.append(
        "(nan accuracy = nothing answered; TypeI_cs / n0_cs: covariate-shift rule "
        "and its accepted H0 points)"
    )
    return "\n".join(lines)
