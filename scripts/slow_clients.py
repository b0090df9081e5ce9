#!/usr/bin/env python3
"""Hold many misbehaving connections open against a node (docs/reliability.md).

Opens SLOW connections that send a request head and then one body byte every 5 s,
and IDLE connections that send nothing, spread over source addresses 127.0.<a>.<b>
(so neither the per-address cap nor the ephemeral port range decides alone), and
keeps them open (reopening what the node closes) until killed. Prints, every 5 s,
how many of each are open. Plain Python 3, no packages.

usage: slow_clients.py HOST:PORT SLOW IDLE FIRST_SOURCE_OCTET
"""
import asyncio
import sys

HEAD = (b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\n"
        b"content-type: application/json\r\ncontent-length: 100000\r\n\r\n{")


async def hold(kind, i, host, port, octet, counts):
    src = (f"127.{octet + (i // 60000)}.{1 + (i // 250) % 250}.{1 + i % 250}", 0)
    while True:
        try:
            reader, writer = await asyncio.open_connection(host, port, local_addr=src)
        except OSError:
            await asyncio.sleep(1.0)
            continue
        counts[kind] += 1
        try:
            if kind == "slow":
                writer.write(HEAD)
                await writer.drain()
                while True:
                    await asyncio.sleep(5.0)
                    writer.write(b" ")
                    await writer.drain()
                    if reader.at_eof():
                        break
            else:
                await reader.read(1)
        except OSError:
            pass
        finally:
            counts[kind] -= 1
            counts[kind + "_closed"] += 1
            writer.close()
        await asyncio.sleep(0.5)


async def main():
    host, port = sys.argv[1].rsplit(":", 1)
    slow, idle, octet = int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    counts = {"slow": 0, "idle": 0, "slow_closed": 0, "idle_closed": 0}
    tasks = [asyncio.create_task(hold("slow", i, host, int(port), octet, counts))
             for i in range(slow)]
    tasks += [asyncio.create_task(hold("idle", slow + i, host, int(port), octet, counts))
              for i in range(idle)]
    while True:
        await asyncio.sleep(5.0)
        print(" ".join(f"{k}={v}" for k, v in counts.items()), flush=True)


if __name__ == "__main__":
    asyncio.run(main())
