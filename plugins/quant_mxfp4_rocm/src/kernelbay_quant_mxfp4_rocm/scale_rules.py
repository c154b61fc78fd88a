"""The three OCP MX scale rules side by side on two MXFP4 blocks, computed by the reference
(``kernelbay.formats.mx``). Prints the README's worked example:

    python -m kernelbay_quant_mxfp4_rocm.scale_rules
"""

from __future__ import annotations

__all__ = ["BLOCKS", "main", "worked_example"]

#: The first four elements of two blocks of 32 (the other 28 are zero).
BLOCKS: tuple[tuple[float, ...], ...] = ((6.8, -2.6, 0.7, 0.2), (7.5, 1.3, -0.4, 0.1))


def worked_example() -> list[str]:
    """Markdown table rows: per block and rule, the block exponent X, the E8M0 byte, and the
    four elements read back (``dequantize_mx(quantize_mx(block))``)."""
    import torch
    from kernelbay.formats import dequantize_mx, quantize_mx

    rows = ["| block (first 4 of 32) | rule | X | E8M0 byte | read back |",
            "| --- | --- | ---: | ---: | --- |"]
    for block in BLOCKS:
        x = torch.zeros(1, 32)
        x[0, :4] = torch.tensor(block)
        for rule in ("floor", "even", "rceil"):
            data, scales = quantize_mx(x, "e2m1", rule)
            back = dequantize_mx(data, scales, "e2m1")[0, :4].tolist()
            byte = int(scales[0, 0])
            rows.append(f"| {list(block)} | {rule} | {byte - 127} | {byte} | {back} |")
    return rows


def main() -> None:
    """Print the table."""
    print("\n".join(worked_example()))


if __name__ == "__main__":
    main()
