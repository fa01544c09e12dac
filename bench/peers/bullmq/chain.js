// BullMQ peer of `make bench`: the 3-step chained no-op (thinker -> talker -> code2wav), through
// BullMQ's public API only (Queue.add, Worker, QueueEvents). Driven by bench/peers/bullmq_chain.py.
//
//   node chain.js worker --url URL --concurrency 8
//       three Workers (one per queue, each at --concurrency) in this process; step k's processor adds
//       the job of step k+1 with Queue.add; INCRs bench:ready once all three are ready.
//   node chain.js client --url URL --mode burst|latency --n N [--concurrency 8] [--warmup 100]
//       adds the thinker jobs and observes each chain's end with QueueEvents on the code2wav queue
//       ('completed', whose returnvalue names the workflow). Protocol on stdio (one JSON line each):
//       prints {"event":"warm"} after the warm-up and waits for a line on stdin; runs the measured
//       phase; prints {"event":"done","records":[[wf, submit_s, done_s], ...]}; exits when stdin closes.
//
// Defaults everywhere (job options, retention, lock and stalled settings) except concurrency.
'use strict';

const readline = require('node:readline');
const { performance } = require('node:perf_hooks');
const { Queue, Worker, QueueEvents } = require('bullmq');
const IORedis = require('ioredis');

const TEXT_CHUNKS = 4;       // bench/workload.py
const AUDIO_BYTES = 64;
const READY_KEY = 'bench:ready';

function parseArgs(argv) {
  const out = { _: [] };
  for (let i = 0; i < argv.length; i++) {
    if (argv[i].startsWith('--')) out[argv[i].slice(2)] = argv[++i];
    else out._.push(argv[i]);
  }
  return out;
}

function connectionOf(url) {
  const u = new URL(url);
  const db = u.pathname.length > 1 ? Number(u.pathname.slice(1)) : 0;
  return { host: u.hostname, port: Number(u.port || 6379), db, maxRetriesPerRequest: null };
}

const nowS = () => (performance.timeOrigin + performance.now()) / 1000;

// the workload of bench/workload.py
const thinker = prompt => Array.from({ length: TEXT_CHUNKS }, (_, i) => `${prompt}:${i}`);
const talker = texts => texts.map((t, i) => [t.length, i]);
const code2wav = () => Buffer.alloc(AUDIO_BYTES);

async function worker(args) {
  const connection = connectionOf(args.url);
  const concurrency = Number(args.concurrency || 1);
  const talkerQ = new Queue('talker', { connection });
  const code2wavQ = new Queue('code2wav', { connection });
  const workers = [
    new Worker('thinker', async job => {
      await talkerQ.add('talker', { wf: job.data.wf, texts: thinker(job.data.prompt) });
    }, { connection, concurrency }),
    new Worker('talker', async job => {
      await code2wavQ.add('code2wav', { wf: job.data.wf, codes: talker(job.data.texts) });
    }, { connection, concurrency }),
    new Worker('code2wav', async job => ({ wf: job.data.wf, bytes: code2wav(job.data.codes).length }),
      { connection, concurrency }),
  ];
  for (const w of workers) w.on('error', err => console.error('worker error', err));
  await Promise.all([talkerQ.waitUntilReady(), code2wavQ.waitUntilReady(), ...workers.map(w => w.waitUntilReady())]);
  const ready = new IORedis(args.url);
  await ready.incr(READY_KEY);
  await ready.quit();
  const stop = async () => {
    await Promise.all(workers.map(w => w.close(true)));
    await Promise.all([talkerQ.close(), code2wavQ.close()]);
    process.exit(0);
  };
  process.on('SIGTERM', stop);
  process.on('SIGINT', stop);
}

class Chains {
  // Submits chains and resolves each one when QueueEvents reports its code2wav job completed.
  constructor(url) {
    const connection = connectionOf(url);
    this.queue = new Queue('thinker', { connection });
    // from the stream's start, not '$': events written before the first XREAD would be missed (seen
    // under load with 2 worker processes: a warm-up chain finished before the reader's first read)
    this.events = new QueueEvents('code2wav', { connection, lastEventId: '0-0' });
    this.waiting = new Map();
    this.events.on('completed', ({ returnvalue }) => {
      const resolve = this.waiting.get(returnvalue.wf);
      if (resolve) {
        this.waiting.delete(returnvalue.wf);
        resolve(nowS());
      }
    });
    this.events.on('failed', ({ jobId, failedReason }) => console.error(`code2wav job ${jobId} failed: ${failedReason}`));
  }

  async ready() {
    await Promise.all([this.queue.waitUntilReady(), this.events.waitUntilReady()]);
  }

  // one workflow: resolves to [wf, submit_s, done_s] once the client has seen its chain finish
  async run(wf) {
    const finished = new Promise(resolve => this.waiting.set(wf, resolve));
    const ts = nowS();
    await this.queue.add('thinker', { wf, prompt: 'hello' });
    return [wf, ts, await finished];
  }

  // a burst: the n chains are added as fast as `concurrency` submitters can; completion from QueueEvents
  async burst(prefix, n, concurrency) {
    // `concurrency` submitters, each awaiting its Queue.add before it takes the next index;
    // every chain's end is observed by the one QueueEvents reader
    const pending = [];
    let next = 0;
    const submitters = Array.from({ length: concurrency }, async () => {
      while (next < n) {
        const wf = `${prefix}-${next++}`;
        const finished = new Promise(resolve => this.waiting.set(wf, resolve));
        const ts = nowS();
        await this.queue.add('thinker', { wf, prompt: 'hello' });
        pending.push(finished.then(done => [wf, ts, done]));
      }
    });
    await Promise.all(submitters);
    return Promise.all(pending);
  }

  async latency(prefix, n) {
    const records = [];
    for (let i = 0; i < n; i++) records.push(await this.run(`${prefix}-${i}`));
    return records;
  }

  async close() {
    await this.events.close();
    await this.queue.close();
  }
}

async function client(args) {
  const chains = new Chains(args.url);
  await chains.ready();
  const n = Number(args.n);
  const concurrency = Number(args.concurrency || 8);
  const warmup = Number(args.warmup || 100);
  const lines = readline.createInterface({ input: process.stdin });
  const nextLine = () => new Promise(resolve => lines.once('line', resolve));
  const closed = new Promise(resolve => lines.once('close', resolve));
  if (args.mode === 'burst') await chains.burst('warm', warmup, concurrency);
  else await chains.latency('warm', warmup);
  process.stdout.write(JSON.stringify({ event: 'warm' }) + '\n');
  await nextLine();
  const records = args.mode === 'burst' ? await chains.burst('wf', n, concurrency) : await chains.latency('lat', n);
  process.stdout.write(JSON.stringify({ event: 'done', records }) + '\n');
  await closed;
  await chains.close();
  process.exit(0);
}

const args = parseArgs(process.argv.slice(2));
const main = { worker, client }[args._[0]];
if (!main || !args.url) {
  console.error('usage: node chain.js worker|client --url URL [...]');
  process.exit(2);
}
main(args).catch(err => {
  console.error(err);
  process.exit(1);
});
