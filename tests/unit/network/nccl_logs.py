"""NCCL_DEBUG=INFO excerpts in the formats NCCL and aws-ofi-nccl print, for the log parser and the checks.

Lines are from public NVIDIA/nccl and aws/aws-ofi-nccl threads (cited above each excerpt; host names
and addresses changed) or, where no thread shows the line, built from the format string in the
source that prints it (cited the same way).
"""

# --- InfiniBand and TCP ---------------------------------------------------------------------------

IB_LOG = """\
gpu-a:1204:1204 [0] NCCL INFO Bootstrap : Using eth0:10.0.0.1<0>
gpu-a:1204:1204 [0] NCCL INFO NET/Plugin : No plugin found (libnccl-net.so), using internal implementation
gpu-a:1204:1301 [0] NCCL INFO NET/IB : Using [0]mlx5_ib0:1/IB [1]mlx5_ib1:1/IB [RO]; OOB eth0:10.0.0.1<0>
gpu-a:1204:1301 [0] NCCL INFO Using network IB
gpu-a:1204:1301 [0] NCCL INFO Channel 00/0 : 0[0] -> 1[1] via P2P/CUMEM/read
gpu-a:1204:1301 [0] NCCL INFO Channel 00/0 : 8[0] -> 0[0] [receive] via NET/IB/0/GDRDMA
gpu-a:1204:1301 [0] NCCL INFO Channel 00/0 : 0[0] -> 8[0] [send] via NET/IB/0/GDRDMA
gpu-a:1204:1301 [0] NCCL INFO Connected all rings
"""

SOCKET_LOG = """\
ip-172-31-12-21:45361:45361 [0] NCCL INFO NET/IB : No device found.
ip-172-31-12-21:45361:45361 [0] NCCL INFO NET/Socket : Using [0]ens3:172.31.12.21<0>
ip-172-31-12-21:45361:45400 [0] NCCL INFO Using network Socket
ip-172-31-12-21:45361:45400 [0] NCCL INFO Channel 00/0 : 1[0] -> 0[0] [receive] via NET/Socket/0
ip-172-31-12-21:45361:45400 [0] NCCL INFO Channel 00/0 : 0[0] -> 1[0] [send] via NET/Socket/0
ip-172-31-12-21:45361:45400 [0] NCCL INFO Channel 01/0 : 0[0] -> 1[1] via SHM/direct/direct
"""

# HPC-X's SHARP plugin: the network is named IBext_v8, and is InfiniBand all the same.
IBEXT_LOG = """\
host-7:987:1260 [7] NCCL INFO Using network IBext_v8
host-7:987:1260 [7] NCCL INFO Channel 03/0 : 47[7] -> 39[7] [receive] via NET/IBext_v8/2
"""

# One node, two GPUs: no channel leaves the node, only the network choice says what NCCL loaded.
SINGLE_NODE_SOCKET_LOG = """\
h200:77:77 [0] NCCL INFO NET/IB : No device found.
h200:77:90 [0] NCCL INFO Using network Socket
h200:77:90 [0] NCCL INFO Channel 00/0 : 0[0] -> 1[1] via P2P/IPC
"""

# NCCL 2.28.9 (torch 2.11+cu130) on a machine without HCAs, as preflight captured it on the H200 VM.
NCCL_228_NO_IB_LOG = """\
vm:746:746 [0] NCCL INFO NCCL version 2.28.9+cuda13.0
vm:746:746 [0] NCCL INFO NET/Plugin: Could not find: libnccl-net.so
vm:746:746 [0] NCCL INFO NET/IB : No device found.
vm:746:746 [0] NCCL INFO NET/IB : Using [RO]; OOB eth0:192.0.2.2<0>
vm:746:746 [0] NCCL INFO Failed to initialize NET plugin IB
vm:746:746 [0] NCCL INFO NET/Socket : Using [0]eth0:192.0.2.2<0>
vm:746:746 [0] NCCL INFO Initialized NET plugin Socket
vm:746:746 [0] NCCL INFO Assigned NET plugin Socket to comm
vm:746:746 [0] NCCL INFO Using network Socket
vm:746:746 [0] NCCL INFO Channel 00/64 : 0
"""

# --- EFA (aws-ofi-nccl over libfabric) ------------------------------------------------------------

# Healthy, aws-ofi-nccl at HEAD on p5: the provider line of nccl_ofi_net.cpp
# (nccl_net_ofi_query_provider_capabilities) and the plugin's default network name "Libfabric".
EFA_LOG = """\
ip-10-1-0-5:311:311 [0] NCCL INFO NET/OFI Initializing aws-ofi-nccl 1.21.1
ip-10-1-0-5:311:311 [0] NCCL INFO NET/OFI Using Libfabric version 2.3
ip-10-1-0-5:311:311 [0] NCCL INFO NET/OFI Configuring AWS-specific options
ip-10-1-0-5:311:311 [0] NCCL INFO NET/OFI Selected provider is efa, fabric is efa-direct (found 32 nics)
ip-10-1-0-5:311:402 [0] NCCL INFO Using network Libfabric
ip-10-1-0-5:311:402 [0] NCCL INFO Channel 00/0 : 0[0] -> 1[1] via P2P/CUMEM/read
ip-10-1-0-5:311:402 [0] NCCL INFO Channel 00/0 : 8[0] -> 0[0] [receive] via NET/Libfabric/0/GDRDMA
ip-10-1-0-5:311:402 [0] NCCL INFO Channel 00/0 : 0[0] -> 8[0] [send] via NET/Libfabric/0/GDRDMA
"""

# Healthy on p5en with NCCL_NET="AWS Libfabric", as raytrain sets it: aws-ofi-nccl 1.13 then names
# itself "AWS Libfabric" (NVIDIA/nccl#1597: "Selected Provider is efa (found 16 nics)", "via NET/AWS
# Libfabric/1/GDRDMA"; the version line in the format of aws/aws-ofi-nccl#715, "1.11.0-aws"; 1.13.x
# is the last release with this provider line).
EFA_AWS_LIBFABRIC_LOG = """\
8h200-2:14630:14695 [1] NCCL INFO NET/OFI Initializing aws-ofi-nccl 1.13.2-aws
8h200-2:14630:14695 [1] NCCL INFO NET/OFI Selected Provider is efa (found 16 nics)
8h200-2:14630:14695 [1] NCCL INFO NET/OFI NIC group 0 device #0 0000:56:00.0
8h200-2:14630:14695 [1] NCCL INFO Using network AWS Libfabric
8h200-2:14630:14695 [1] NCCL INFO Channel 05/0 : 0[0] -> 1[1] [receive] via NET/AWS Libfabric/1/GDRDMA
8h200-2:14630:14695 [1] NCCL INFO Channel 00/0 : 1[1] -> 0[0] [send] via NET/AWS Libfabric/1/GDRDMA
"""

# The plugin is not on the loader path, NCCL_NET unset: NCCL falls back to sockets without a word
# of warning besides these (EFA on AWS Batch, NVIDIA/nccl#959: "NET/Plugin : No plugin found
# (libnccl-net.so)." and "misc/ibvwrap.cc:63 NCCL WARN Failed to open libibverbs.so[.1]").
EFA_NO_PLUGIN_SOCKET_LOG = """\
ip-10-1-0-6:52:52 [0] NCCL INFO Bootstrap : Using ens32:10.1.0.6<0>
ip-10-1-0-6:52:52 [0] NCCL INFO NET/Plugin : No plugin found (libnccl-net.so).
ip-10-1-0-6:52:52 [0] misc/ibvwrap.cc:63 NCCL WARN Failed to open libibverbs.so[.1]
ip-10-1-0-6:52:52 [0] NCCL INFO NET/Socket : Using [0]ens32:10.1.0.6<0>
ip-10-1-0-6:52:90 [0] NCCL INFO Using network Socket
ip-10-1-0-6:52:90 [0] NCCL INFO Channel 00/0 : 0[0] -> 8[0] [send] via NET/Socket/0
"""

# The plugin is missing and raytrain's NCCL_NET="AWS Libfabric" holds NCCL to it: NCCL >= 2.23 says
# "Could not find" (plugin/plugin_open.cc) and the communicator fails ("Failed to initialize any NET
# plugin", WARN, plugin/net.cc ncclNetInit): no network line at all.
EFA_NO_PLUGIN_PINNED_LOG = """\
ip-10-1-0-7:61:61 [0] NCCL INFO NCCL version 2.27.7+cuda12.9
ip-10-1-0-7:61:61 [0] NCCL INFO NET/Plugin: Could not find: libnccl-net.so
ip-10-1-0-7:61:61 [0] plugin/net.cc:349 NCCL WARN Failed to initialize any NET plugin
"""

# The plugin exists but the loader cannot open a library it needs (plugin/plugin_open.cc prints
# "<plugin>: <dlerror>" for anything but the plugin itself missing).
EFA_PLUGIN_LOAD_ERROR_LOG = """\
ip-10-1-0-8:70:70 [0] NCCL INFO NET/Plugin: libnccl-net.so: libfabric.so.1: cannot open shared object file: No such file or directory
ip-10-1-0-8:70:70 [0] NCCL INFO NET/IB : No device found.
ip-10-1-0-8:70:70 [0] NCCL INFO Using network Socket
"""

# The plugin loaded, but libfabric offered it only its tcp provider: a plugin built without
# --enable-platform-aws in a container (aws/aws-ofi-nccl#803, p4d + docker, verbatim but the host).
EFA_TCP_PROVIDER_LOG = """\
6f2d8a82d208:1287:1328 [0] NCCL INFO NET/Plugin: Failed to find ncclCollNetPlugin_v8 symbol.
6f2d8a82d208:1287:1328 [0] NCCL INFO NET/OFI Initializing aws-ofi-nccl 1.12.1-aws
6f2d8a82d208:1287:1328 [0] NCCL INFO NET/OFI Using Libfabric version 1.22
6f2d8a82d208:1287:1328 [0] NCCL INFO NET/OFI Using CUDA driver version 12020
6f2d8a82d208:1287:1328 [0] NCCL INFO NET/OFI Using transport protocol SENDRECV
6f2d8a82d208:1287:1328 [0] NCCL INFO NET/OFI Selected Provider is tcp (found 1 nics)
6f2d8a82d208:1287:1328 [0] NCCL INFO Using network AWS Libfabric
"""

# The plugin loaded, but the container lacks /dev/infiniband, so libfabric finds no EFA device and
# NCCL falls back to sockets (aws-samples/aws-do-eks#54: "NET/OFI No eligible providers were found",
# "NET/OFI aws-ofi-nccl initialization failed", "Initialized NET plugin Socket"; aws/aws-ofi-nccl#1020:
# "NCCL WARN NET/OFI OFI fi_getinfo() call failed: No data available").
EFA_NO_DEVICES_LOG = """\
ip-10-1-0-9:79:79 [0] NCCL INFO NET/OFI Initializing aws-ofi-nccl 1.14.0
ip-10-1-0-9:79:79 [0] NCCL INFO NET/OFI Using transport protocol RDMA (platform set)
ip-10-1-0-9:79:79 [0] nccl_net_ofi_rdma_init:7978 NCCL WARN NET/OFI OFI fi_getinfo() call failed: No data available
ip-10-1-0-9:79:79 [0] NCCL INFO NET/OFI No eligible providers were found
ip-10-1-0-9:79:79 [0] NCCL INFO NET/OFI aws-ofi-nccl initialization failed
ip-10-1-0-9:79:79 [0] NCCL INFO NET/IB : No device found.
ip-10-1-0-9:79:79 [0] NCCL INFO Failed to initialize NET plugin IB
ip-10-1-0-9:79:79 [0] NCCL INFO Initialized NET plugin Socket
ip-10-1-0-9:79:90 [0] NCCL INFO Using network Socket
"""
