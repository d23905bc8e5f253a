// The pyshmckpt._C module: Segment, CopyEvent and a few free functions. Names are snake_case,
// failed system calls become OSError with errno, bad arguments become ValueError.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "checksum.h"
#include "copy_engine.h"
#include "cuda_driver.h"
#include "device_copies.h"
#include "errors.h"
#include "file_reader.h"
#include "page_populate.h"
#include "pinning.h"
#include "segment.h"
#include "thread_pool.h"

namespace py = pybind11;
using namespace pyshmckpt;

namespace {

using U64Array = py::array_t<std::uint64_t, py::array::c_style | py::array::forcecast>;

const CopyEntry* entries_of(const U64Array& entries, std::size_t* count) {
  if (entries.ndim() != 2 || entries.shape(1) != 3) {
    throw ArgumentError("copy entries must be an array of shape (n, 3): src, dst offset, nbytes");
  }
  static_assert(sizeof(CopyEntry) == 3 * sizeof(std::uint64_t), "CopyEntry must be packed");
  *count = static_cast<std::size_t>(entries.shape(0));
  return reinterpret_cast<const CopyEntry*>(entries.data());
}

// Keeps the mapping alive while the GIL is released, even if another thread closes the segment.
class MappingUse {
 public:
  explicit MappingUse(Segment& segment) : segment_(segment) { segment_.acquire_export(); }
  ~MappingUse() { segment_.release_export(); }
  MappingUse(const MappingUse&) = delete;
  MappingUse& operator=(const MappingUse&) = delete;

 private:
  Segment& segment_;
};

// Runs `fill` (copy_host, write_host_through_file) over (n, 3) host entries, the segment's
// mapping kept alive and the GIL released meanwhile.
template <typename Fill>
auto run_host_entries(Segment& s, const U64Array& entries, Fill fill) {
  std::size_t count = 0;
  const CopyEntry* e = entries_of(entries, &count);
  MappingUse use(s);
  py::gil_scoped_release release;
  return fill(s, e, count);
}

int segment_getbuffer(PyObject* obj, Py_buffer* view, int flags) {
  view->obj = nullptr;
  Segment* segment = nullptr;
  try {
    segment = py::handle(obj).cast<Segment*>();
  } catch (const std::exception&) {
    PyErr_SetString(PyExc_BufferError, "not a pyshmckpt segment");
    return -1;
  }
  if (segment == nullptr || segment->closed()) {
    PyErr_SetString(PyExc_BufferError, "segment is closed");
    return -1;
  }
  if (PyBuffer_FillInfo(view, obj, segment->base(), static_cast<Py_ssize_t>(segment->mapped_size()),
                        0, flags) != 0) {
    return -1;
  }
  segment->acquire_export();
  return 0;
}

void segment_releasebuffer(PyObject* obj, Py_buffer*) {
  try {
    py::handle(obj).cast<Segment*>()->release_export();
  } catch (const std::exception&) {
    // Only pyshmckpt segments reach here; nothing to release otherwise.
  }
}

}  // namespace

PYBIND11_MODULE(_C, m) {
  m.doc() = "Native core of pyshmckpt: shared-memory segments, pinning, copies, checksums.";

  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const SyscallError& e) {
      std::string message = e.call() + ": " + e.detail();
      py::object err = py::module_::import("builtins").attr("OSError")(e.err(), message, e.name());
      PyErr_SetObject(reinterpret_cast<PyObject*>(Py_TYPE(err.ptr())), err.ptr());
    } catch (const CudaError& e) {
      py::object type = py::module_::import("pyshmckpt.errors").attr("CudaError");
      PyErr_SetString(type.ptr(), e.what());
    } catch (const ArgumentError& e) {
      PyErr_SetString(PyExc_ValueError, e.what());
    }
  });

  m.attr("HEADER_SIZE") = kHeaderSize;
  m.attr("TOKEN_SIZE") = kTokenSize;

  py::class_<CopyEvent, std::unique_ptr<CopyEvent>>(m, "CopyEvent",
                                                    "Completion of a batch of device-to-host copies.")
      .def("query", &CopyEvent::query, "True once every copy of the batch has completed.")
      .def("wait", &CopyEvent::wait, py::arg("timeout"), py::call_guard<py::gil_scoped_release>(),
           "Wait up to `timeout` seconds (negative: no limit) with the GIL released; True when done.")
      .def_property_readonly("device", &CopyEvent::device);

  // Holds the segment's mapping (an export) until waited for or destroyed.
  struct PyHostCopy {
    std::unique_ptr<HostCopy> copy;
    Segment* segment;
    bool released = false;
    void finish() {
      if (!released) {
        released = true;
        segment->release_export();
      }
    }
    ~PyHostCopy() {
      copy.reset();  // joins the thread
      finish();
    }
  };
  py::class_<PyHostCopy>(m, "HostCopy", "A host copy running in the background.")
      .def(
          "wait",
          [](PyHostCopy& c) {
            try {
              py::gil_scoped_release release;
              c.copy->wait();
            } catch (...) {
              c.finish();
              throw;
            }
            c.finish();
          },
          "Wait for the copy (GIL released) and raise its error, if any.")
      .def_property_readonly("done", [](const PyHostCopy& c) { return c.copy->done(); });

  py::class_<Segment, std::unique_ptr<Segment>> segment(m, "Segment", py::buffer_protocol(),
                                                        R"doc(
A named POSIX shared-memory segment with a one-page header. Offsets are from the start of the
mapping; data lives in [data_offset, data_offset + size). The buffer protocol exposes the whole
mapping, writable and zero-copy; the mapping stays valid while any exported view is alive.
)doc");
  segment
      .def_static(
          "create",
          [](std::size_t size, const std::string& prefix, bool populate) {
            py::gil_scoped_release release;
            return std::make_unique<Segment>(Segment::create(size, prefix, populate));
          },
          py::arg("size"), py::arg("prefix") = "pyshmckpt", py::arg("populate") = true,
          "Create a 0600 segment with `size` data bytes (rounded up to pages), every page reserved\n"
          "(fallocate) and mapped (with populate=False only the header's: fill the rest through\n"
          "the file, or with `allocate_pages` or `populate`). The open segment holds a shared\n"
          "flock, which keeps stale-segment collection from it. A full /dev/shm raises\n"
          "OSError(ENOSPC).")
      .def_static(
          "attach",
          [](const std::string& name, std::size_t size, const py::bytes& token, bool map_pages) {
            std::string raw = token;
            py::gil_scoped_release release;
            return std::make_unique<Segment>(Segment::attach(name, size, raw, map_pages));
          },
          py::arg("name"), py::arg("size"), py::arg("token"), py::arg("map_pages") = true,
          "Map an existing segment after checking owner, permissions, size, header and token\n"
          "(every page at once; with map_pages=False on first access or by map_pages_for_reading).\n"
          "The open segment holds a shared flock, as a created one does; a segment removed as\n"
          "stale meanwhile raises OSError(ENOENT).")
      .def(
          "allocate_pages",
          [](Segment& self, std::size_t offset, std::size_t nbytes) {
            MappingUse use(self);
            py::gil_scoped_release release;
            self.allocate_pages(offset, nbytes);
          },
          py::arg("offset"), py::arg("nbytes"),
          "Allocate (fallocate) and map for writing the pages of bytes [offset, offset + nbytes) of\n"
          "the mapping; safe while other threads write them; a full /dev/shm raises OSError(ENOSPC).")
      .def(
          "populate",
          [](Segment& self, std::size_t offset, std::size_t nbytes) {
            MappingUse use(self);
            py::gil_scoped_release release;
            self.populate(offset, nbytes);
          },
          py::arg("offset"), py::arg("nbytes"),
          "Reserve (fallocate) and map for writing the pages of bytes [offset, offset + nbytes) of\n"
          "the mapping, in parallel; where the kernel cannot map them each page is touched, so\n"
          "nobody may write them meanwhile. A full /dev/shm raises OSError(ENOSPC), never SIGBUS.")
      .def(
          "map_pages_for_reading",
          [](Segment& self, std::size_t nbytes) {
            py::gil_scoped_release release;
            self.map_pages_for_reading(nbytes);
          },
          py::arg("nbytes") = 0,
          "Map the pages of the first `nbytes` bytes of the mapping (the header included; 0: all)\n"
          "for reading now, so that reading them takes no page fault.")
      .def_property_readonly("name", &Segment::name)
      .def_property_readonly("size", &Segment::size)
      .def_property_readonly("mapped_size", &Segment::mapped_size)
      .def_property_readonly("data_offset", &Segment::data_offset)
      .def_property_readonly("fd", &Segment::fd)
      .def_property_readonly("owner", &Segment::owner)
      .def_property_readonly("closed", &Segment::closed)
      .def_property_readonly("unlinked", &Segment::unlinked)
      .def_property_readonly("exports", &Segment::exports)
      .def_property_readonly("token", [](const Segment& s) { return py::bytes(s.token()); })
      .def_property_readonly("address",
                             [](const Segment& s) { return reinterpret_cast<std::uintptr_t>(s.base()); })
      .def_property_readonly("pinned", &Segment::pinned)
      .def_property_readonly("pin_error", &Segment::pin_error)
      .def("unlink", &Segment::unlink, "Remove the name from /dev/shm; idempotent.")
      .def("close", &Segment::close,
           "Unpin, unlink if created here, and unmap once no view is exported; idempotent.")
      .def("pin", &Segment::pin, py::arg("chunk_bytes") = std::size_t{1} << 30,
           py::call_guard<py::gil_scoped_release>(),
           "cuMemHostRegister the mapping in chunks; False (see pin_error) when it cannot be pinned.")
      .def("unpin", &Segment::unpin, py::call_guard<py::gil_scoped_release>())
      .def("disown", &Segment::disown,
           "Leave the segment's name in place at close: another process takes it over.")
      .def("keep_mapped", &Segment::keep_mapped,
           "Device copies may still land: never unpin or unmap the mapping from now on.")
      .def_property_readonly("kept_mapped", &Segment::kept_mapped)
      .def(
          "copy_from_host",
          [](Segment& s, const U64Array& entries) { run_host_entries(s, entries, copy_host); },
          py::arg("entries"),
          R"doc(
Copy host memory into the segment: `entries` is a (n, 3) uint64 array of source address,
destination offset and byte count. Runs on the thread pool with the GIL released.
SAFETY: every source address must be readable for its byte count and stay alive and unmodified
until this returns; the caller keeps the owning objects alive.
)doc")
      .def(
          "write_from_host",
          [](Segment& s, const U64Array& entries) {
            return run_host_entries(s, entries, write_host_through_file);
          },
          py::arg("entries"),
          R"doc(
Write host memory into the segment through its file (pwritev), not its mapping: entries as for
copy_from_host. For pages never allocated, twice as fast as allocating and then copying; a full
/dev/shm raises OSError(ENOSPC). A batch of 32 MiB or more is shared with a helper thread, which
maps and copies 4 MiB pieces from its end while this one writes from its start; returns the bytes
the helper filled (0 for a batch written through the file alone). GIL released. SAFETY: as
copy_from_host.
)doc")
      .def(
          "copy_from_host_async",
          [](Segment& s, const U64Array& entries) {
            std::size_t count = 0;
            const CopyEntry* e = entries_of(entries, &count);
            s.acquire_export();
            auto out = std::make_unique<PyHostCopy>();
            out->segment = &s;
            try {
              out->copy = std::make_unique<HostCopy>(s, e, count);
            } catch (...) {
              out->finish();
              throw;
            }
            return out;
          },
          py::arg("entries"), py::keep_alive<0, 1>(),
          R"doc(
Start copy_from_host on a background thread and return a HostCopy to wait() on. The entries are
copied, bounds are checked before this returns, and the segment stays mapped until the copy is
waited for. SAFETY: as copy_from_host, until wait() returns.
)doc")
      .def(
          "copy_from_device",
          [](Segment& s, const U64Array& entries, std::uintptr_t stream, int device) {
            std::size_t count = 0;
            const CopyEntry* e = entries_of(entries, &count);
            MappingUse use(s);
            py::gil_scoped_release release;
            return copy_device_async(s, e, count, stream, device);
          },
          py::arg("entries"), py::arg("stream"), py::arg("device"),
          R"doc(
Issue device-to-host copies of (n, 3) entries on the CUDA stream handle `stream` of `device` and
return a CopyEvent. SAFETY: sources must be device memory that stays allocated, and unmodified,
until the event completes; the caller keeps the owning tensors alive until then.
)doc")
      .def(
          "checksums",
          [](Segment& s, const U64Array& ranges) {
            if (ranges.ndim() != 2 || ranges.shape(1) != 2) {
              throw ArgumentError("checksum ranges must be an array of shape (n, 2): offset, nbytes");
            }
            const std::size_t count = static_cast<std::size_t>(ranges.shape(0));
            const std::uint64_t* r = ranges.data();
            for (std::size_t i = 0; i < count; ++i) {
              if (r[2 * i] > s.mapped_size() || r[2 * i + 1] > s.mapped_size() - r[2 * i]) {
                throw ArgumentError("checksum range " + std::to_string(i) + " lies outside segment '" +
                                    s.name() + "'");
              }
            }
            py::array_t<std::uint32_t> out(static_cast<py::ssize_t>(count));
            std::uint32_t* o = out.mutable_data();
            MappingUse use(s);
            {
              py::gil_scoped_release release;
              const std::uint8_t* base = s.base();
              ThreadPool::instance().parallel_for(count, [&](std::size_t i) {
                o[i] = crc32c(base + r[2 * i], r[2 * i + 1]);
              });
            }
            return out;
          },
          py::arg("ranges"), "CRC32C of each (offset, nbytes) range, computed in parallel.")
      .def("__enter__", [](Segment& s) -> Segment& { return s; }, py::return_value_policy::reference)
      .def("__exit__", [](Segment& s, const py::args&) { s.close(); })
      .def("__repr__", [](const Segment& s) {
        return "<pyshmckpt._C.Segment '" + s.name() + "' size=" + std::to_string(s.size()) +
               (s.closed() ? " closed" : "") + (s.pinned() ? " pinned" : "") + ">";
      });
  auto* heap = reinterpret_cast<PyHeapTypeObject*>(segment.ptr());
  heap->as_buffer.bf_getbuffer = segment_getbuffer;
  heap->as_buffer.bf_releasebuffer = segment_releasebuffer;

  m.def("cuda_device_count", &cuda_device_count,
        "CUDA devices the driver sees; 0 without a usable driver or a device. Never raises.");
  m.def(
      "cuda_driver_status",
      []() {
        const CudaDriverStatus& status = cuda_driver().status;
        py::dict out;
        out["usable"] = status.usable;
        out["path"] = status.path;
        out["reason"] = status.reason;
        out["version"] = status.version;
        out["devices"] = status.devices;
        out["missing"] = status.missing;
        out["batched_copies"] = status.batched_copies;
        out["copy_method"] = device_copy_method();
        return out;
      },
      "What loading the CUDA driver found (it is loaded on the first call): usable, path, reason, "
      "version, devices, missing, batched_copies (the batched copy function found, '' when "
      "none), copy_method (how device-to-host copies are queued, in words). Never raises.");
  m.def(
      "is_pinned",
      [](std::uintptr_t address) { return is_pinned_pointer(reinterpret_cast<const void*>(address)); },
      py::arg("address"), "True when CUDA reports the host address as page-locked.");
  m.def(
      "crc32c",
      [](const py::buffer& data, std::uint32_t value) {
        py::buffer_info info = data.request();
        if (!PyBuffer_IsContiguous(info.view(), 'A')) {
          throw ArgumentError("crc32c needs a contiguous buffer");
        }
        const std::size_t nbytes = static_cast<std::size_t>(info.size * info.itemsize);
        py::gil_scoped_release release;
        return crc32c(info.ptr, nbytes, value);
      },
      py::arg("data"), py::arg("value") = 0,
      "CRC32C of a contiguous buffer, continuing from `value`; the GIL is released.");
  m.def(
      "crc32c_combine",
      [](std::uint32_t crc_a, std::uint32_t crc_b, std::uint64_t len_b) {
        return crc32c_combine(crc_a, crc_b, len_b);
      },
      py::arg("crc_a"), py::arg("crc_b"), py::arg("len_b"),
      "CRC32C of A + B from crc32c(A), crc32c(B) and len(B).");
  m.def(
      "read_file_ranges",
      [](int fd, const U64Array& entries, bool checksums, const std::string& path) {
        if (entries.ndim() != 2 || entries.shape(1) != 3) {
          throw ArgumentError("read entries must be an array of shape (n, 3): file offset, address, nbytes");
        }
        static_assert(sizeof(ReadEntry) == 3 * sizeof(std::uint64_t), "ReadEntry must be packed");
        const std::size_t count = static_cast<std::size_t>(entries.shape(0));
        const auto* e = reinterpret_cast<const ReadEntry*>(entries.data());
        for (std::size_t i = 0; i < count; ++i) {
          const std::uint64_t end = e[i].file_offset + e[i].nbytes;
          if (end < e[i].file_offset || end > static_cast<std::uint64_t>(INT64_MAX) ||
              (e[i].nbytes != 0 && e[i].address == 0) ||
              e[i].address + e[i].nbytes < e[i].address) {
            throw ArgumentError("read entry " + std::to_string(i) + " of '" + path +
                                "' has an invalid offset, address or size");
          }
        }
        py::array_t<std::uint32_t> crcs(static_cast<py::ssize_t>(count));
        py::array_t<std::uint64_t> got(static_cast<py::ssize_t>(count));
        std::uint32_t* c = crcs.mutable_data();
        std::uint64_t* g = got.mutable_data();
        {
          py::gil_scoped_release release;
          read_file_ranges(fd, e, count, checksums, path, c, g);
        }
        return py::make_tuple(crcs, got);
      },
      py::arg("fd"), py::arg("entries"), py::arg("checksums"), py::arg("path"),
      R"doc(
Read byte ranges of the open file `fd` into memory with pread on the thread pool, the GIL
released: `entries` is an (n, 3) uint64 array of file offset, destination address and byte count.
Returns (crcs, got): each entry's CRC32C of the bytes as they landed (0 without `checksums`) and
the bytes read (fewer than asked when the file ends first). A failed pread raises OSError with
its errno and `path`.
SAFETY: every destination must be writable memory of at least its byte count, not overlapping
another entry's, that the caller keeps alive and leaves alone until this returns.
)doc");
  m.def("crc32c_hardware", &crc32c_hardware, "True when CRC32C uses a CPU instruction.");
  m.def("num_threads", [] { return ThreadPool::instance().num_threads(); },
        "Threads used by copies, prefaulting and checksums (the caller's included).");
  m.def(
      "set_num_threads",
      [](std::size_t n) {
        if (n == 0 || n > 256) throw ArgumentError("num_threads must be in [1, 256]");
        py::gil_scoped_release release;
        ThreadPool::instance().resize(n);
      },
      py::arg("num_threads"));
  m.def(
      "_force_populate_fallback", &force_populate_fallback, py::arg("forced"),
      "For tests: with forced=True, act as on kernels without MADV_POPULATE_READ/_WRITE (pages\n"
      "touched one by one) in this process until called with False.");
  m.def("_populate_fallback_forced", &populate_fallback_forced,
        "For tests: whether _force_populate_fallback(True) is in effect.");
  m.def(
      "_set_lock_delay",
      [](double seconds) {
        if (!(seconds >= 0 && seconds <= 60)) throw ArgumentError("lock delay must be in [0, 60] s");
        set_lock_delay(seconds);
      },
      py::arg("seconds"),
      "For tests: wait `seconds` between opening a segment and locking it in Segment.create and\n"
      "Segment.attach in this process (0: never), so that a collector can run in between.");
}
