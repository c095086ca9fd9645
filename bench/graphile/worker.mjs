// A graphile-worker worker for bench/compare.py (bench/peers.py starts it as the "graphile-worker"
// system): `node worker.mjs <connection string> <concurrency>`, on the Node 22 that package.json pins. It serves the two workloads of
// the harness, "noop" (returns at once) and "sleep" (waits one second), and bench/sustained.py's
// "sustained" (reports its pickup latency, waits 1 ms, reports its end: bench/pickup.py's datagrams to
// BENCH_PICKUP), prints "ready" once it is running and stops cleanly on SIGTERM.
//
// Settings: the throughput configuration of graphile-worker's own performance page
// (worker.graphile.org/docs/performance): batched fetch through a local queue of 500 jobs and
// batched completion and failure (completeJobBatchDelay / failJobBatchDelay 0), with the
// harness's concurrency (the same for every system) and a pool of one connection more than
// that, at most 25, as the page has (concurrentJobs 24, maxPoolSize 25).
import dgram from "node:dgram";
import { run } from "graphile-worker";

const [connectionString, concurrencyArg] = process.argv.slice(2);
const concurrentJobs = Number(concurrencyArg);
if (!connectionString || !Number.isInteger(concurrentJobs) || concurrentJobs < 1) {
  console.error("usage: node worker.mjs <connection string> <concurrency>");
  process.exit(2);
}

// bench/pickup.py's Reporter: latencies (ms) and ends gathered, flushed every 0.1 s as datagrams of a
// uint32 count of ends and up to 2,000 float32 latencies, little-endian.
const pickup = { latencies: [], ends: 0 };
if (process.env.BENCH_PICKUP) {
  const colon = process.env.BENCH_PICKUP.lastIndexOf(":");
  const host = process.env.BENCH_PICKUP.slice(0, colon);
  const port = Number(process.env.BENCH_PICKUP.slice(colon + 1));
  const socket = dgram.createSocket("udp4");
  socket.unref();
  setInterval(() => {
    const { latencies } = pickup;
    let ends = pickup.ends;
    pickup.latencies = [];
    pickup.ends = 0;
    for (let start = 0; start < Math.max(latencies.length, 1); start += 2000) {
      const chunk = latencies.slice(start, start + 2000);
      if (!ends && !chunk.length) continue;
      const datagram = Buffer.alloc(4 + 4 * chunk.length);
      datagram.writeUInt32LE(ends, 0);
      chunk.forEach((latency, index) => datagram.writeFloatLE(latency, 4 + 4 * index));
      socket.send(datagram, port, host);
      ends = 0;
    }
  }, 100).unref();
}

const quiet = () => () => {};
const runner = await run({
  noHandleSignals: true,
  taskList: {
    noop: async () => {},
    sleep: () => new Promise((resolve) => setTimeout(resolve, 1000)),
    sustained: async (payload) => {
      // Wall-clock milliseconds with a fraction (Date.now() has whole ones), as Python's time.time().
      pickup.latencies.push(performance.timeOrigin + performance.now() - payload.at * 1000);
      await new Promise((resolve) => setTimeout(resolve, 1));
      pickup.ends += 1;
    },
  },
  logger: new (await import("graphile-worker")).Logger(quiet),
  preset: {
    worker: {
      connectionString,
      concurrentJobs,
      maxPoolSize: Math.min(concurrentJobs + 1, 25),
      pollInterval: 1000,
      localQueue: { size: 500 },
      completeJobBatchDelay: 0,
      failJobBatchDelay: 0,
    },
  },
});
console.log("ready");

let stopping = false;
process.on("SIGTERM", () => {
  if (stopping) return;
  stopping = true;
  runner.stop().then(
    () => process.exit(0),
    (error) => {
      console.error(error);
      process.exit(1);
    },
  );
});
await runner.promise;
