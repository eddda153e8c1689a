"""The accelerators ``foundryx plan --gpu`` knows: memory per device and the name the peak-FLOPs
table (foundryx/runtime/devices.py, the speed monitor's table) matches.

Memory is what torch reports as the device's total (``torch.cuda.get_device_properties(0)
.total_memory``), a little under the datasheet figure: the driver keeps some. An MI250X is two
devices of 64 GiB each to torch. ``--gpu-memory`` overrides it.

Each GPU also names the node it usually comes in, for the host-memory plan (plan/host.py): the
node's RAM (``--host-memory`` overrides it) and a read rate for the pretrained weights
(``--read-rate`` overrides it). RAM is the vendor's stated system memory of the reference
node; the read rate is an assumption of ours, not a vendor figure: about a quarter of the
aggregate sequential read of the node's local NVMe data drives (PCIe Gen4 U.2 drives read
~6-7 GB/s each; 8 of them on a DGX), for a checkpoint of many files read by 8 ranks at once
and quantized as it is read; weights on a network filesystem read at its rate, often slower
(give it with --read-rate).

For the communication estimate (tensor-parallel collectives within a node, FSDP's all-gathers
within or across nodes) each GPU has the vendor's peak link rate per direction: NVLink 3 600
GB/s and NVLink 4 900 GB/s bidirectional (300 and 450 per direction), NVLink 5 1.8 TB/s (900),
MI300X / MI325X 7 Infinity Fabric links of 64 GB/s per direction, an MI250X's GCDs 50 GB/s,
a PCIe Gen5 x16 card 64 GB/s; across nodes one 400 Gb/s NIC per GPU (200 Gb/s HDR on DGX A100,
Slingshot's 4 x 200 Gb/s per Frontier node of 8 GCDs). Collectives reach about 80% of these
(nccl-tests' bus bandwidth); the estimate takes the peak times CONTENTION below.
"""

from __future__ import annotations

from dataclasses import dataclass

from foundryx.errors import ConfigError, did_you_mean

GiB = 2**30
DEFAULT_GPU = "h100"
DEFAULT_MFU = 0.40  # the throughput estimate's MFU where no measured row matches (plan/speed.py)
CONTENTION = 0.8  # the share of a link's peak rate collectives reach (nccl-tests' bus bandwidth)


@dataclass(frozen=True)
class Gpu:
    key: str
    device_name: str  # as torch.cuda.get_device_name() gives it (matched by foundryx.runtime.devices)
    memory: int  # bytes
    kind: str  # cuda | rocm
    node: str  # the reference node, in words
    node_gpus: int  # devices per reference node (as torch counts them)
    host_memory: int  # bytes of RAM per node (vendor spec of the reference node)
    read_rate: float  # bytes/s a node reads its local weights at (our assumption, see above)
    link_rate: float = 0.0  # bytes/s one device sends to its node's others (NVLink / xGMI), per direction
    net_rate: float = 0.0  # bytes/s one device sends to other nodes (its share of the node's NICs)


TB = 10**12
GB = 10**9
GPUS = {g.key: g for g in (
    # NVIDIA DGX A100 datasheet: "System Memory 1TB" (DGX A100 320GB, 8x A100 40GB) and
    # "2TB" (DGX A100 640GB, 8x A100 80GB); data cache: 15 TB of U.2 NVMe (4 x 3.84 TB; 8 on
    # the 640GB system).
    Gpu("a100-40gb", "NVIDIA A100-SXM4-40GB", int(39.4 * GiB), "cuda", "DGX A100 320GB", 8,
        1 * TB, 5 * GB, link_rate=300 * GB, net_rate=25 * GB),
    Gpu("a100-80gb", "NVIDIA A100-SXM4-80GB", int(79.2 * GiB), "cuda", "DGX A100 640GB", 8,
        2 * TB, 10 * GB, link_rate=300 * GB, net_rate=25 * GB),
    # NVIDIA DGX H100 datasheet: "System Memory 2TB"; internal storage 8x 3.84 TB NVMe U.2.
    Gpu("h100", "NVIDIA H100 80GB HBM3", int(79.1 * GiB), "cuda", "DGX H100", 8, 2 * TB,
        10 * GB, link_rate=450 * GB, net_rate=50 * GB),
    # No reference node for the PCIe card: a 2-socket server with 1 TB and 2 NVMe drives.
    Gpu("h100-pcie", "NVIDIA H100 PCIe", int(79.1 * GiB), "cuda", "8x H100 PCIe server", 8,
        1 * TB, 3 * GB, link_rate=64 * GB, net_rate=50 * GB),
    # NVIDIA DGX H200 datasheet: "System Memory 2TB"; internal storage 8x 3.84 TB NVMe U.2.
    Gpu("h200", "NVIDIA H200", int(139.8 * GiB), "cuda", "DGX H200", 8, 2 * TB, 10 * GB,
        link_rate=450 * GB, net_rate=50 * GB),
    # NVIDIA DGX B200 datasheet: "System Memory 2TB, configurable to 4TB"; 8x 3.84 TB NVMe.
    Gpu("b200", "NVIDIA B200", int(178.4 * GiB), "cuda", "DGX B200", 8, 2 * TB, 10 * GB,
        link_rate=900 * GB, net_rate=50 * GB),
    # HPE Cray EX235a (the Frontier node, OLCF's system guide): 512 GB DDR4 for 4 MI250X,
    # i.e. 8 devices; 2 local NVMe drives.
    Gpu("mi250x", "AMD Instinct MI250X", int(64.0 * GiB), "rocm", "HPE Cray EX235a", 8,
        512 * GB, 3 * GB, link_rate=50 * GB, net_rate=12.5 * GB),
    # 8x MI300X OAM servers (AMD's reference platform in OEM servers, e.g. Dell PowerEdge
    # XE9680, Supermicro AS-8125GS-TNMR2): 24-32 DIMMs, shipped with 1.5-3 TB, commonly 2 TB
    # (32 x 64 GB DDR5); 8 NVMe U.2 bays. Check yours and give --host-memory.
    Gpu("mi300x", "AMD Instinct MI300X", int(191.5 * GiB), "rocm", "8x MI300X server", 8,
        2 * TB, 10 * GB, link_rate=448 * GB, net_rate=50 * GB),
    # 8x MI325X servers: the same chassis as the MI300X ones (2 TB commonly).
    Gpu("mi325x", "AMD Instinct MI325X", int(255.5 * GiB), "rocm", "8x MI325X server", 8,
        2 * TB, 10 * GB, link_rate=448 * GB, net_rate=50 * GB),
)}


def find_gpu(name: str) -> Gpu:
    key = name.lower().replace("_", "-")
    if key in GPUS:
        return GPUS[key]
    raise ConfigError([f"--gpu: unknown GPU {name!r}{did_you_mean(key, list(GPUS))}; known: "
                       f"{', '.join(GPUS)} (or give --gpu-memory, e.g. --gpu-memory 80GB)"])


UNITS = {"b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
         "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_memory(text: str, flag: str = "--gpu-memory") -> int:
    """``80GB``, ``80 GiB``, ``141gb``, ``1.5TB`` -> bytes (GB = 10^9, GiB = 2^30)."""
    t = text.strip().lower().replace(" ", "")
    num = t.rstrip("abcdefghijklmnopqrstuvwxyz")
    unit = t[len(num):] or None
    try:
        value = float(num)
    except ValueError:
        value = -1.0
    if unit not in UNITS or value <= 0:
        raise ConfigError([f"{flag}: cannot read {text!r}; write a number and a unit, e.g. "
                           "80GB or 79.1GiB (units: " + ", ".join(u.upper() if u == "b" else u
                                                                   for u in UNITS) + ")"])
    return int(value * UNITS[unit])


def parse_rate(text: str) -> float:
    """``2GB/s``, ``500MB/s``, ``1.5GiB/s`` -> bytes per second."""
    t = text.strip()
    body = t[:-2] if t.lower().endswith("/s") else t
    try:
        return float(parse_memory(body, "--read-rate"))
    except ConfigError:
        raise ConfigError([f"--read-rate: cannot read {text!r}; write a rate, e.g. 2GB/s or "
                           "500MB/s"]) from None
