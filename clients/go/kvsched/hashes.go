package kvsched

import (
	"encoding/binary"
	"fmt"
)

// HashBytes is the size of one packed block hash.
const HashBytes = 8

// PackHashes returns block hashes as the packed_block_hashes fields carry them: each uint64
// little-endian, 8 bytes, one after the other. Set it instead of block_hashes (never both):
// the Conductor reads the packed form faster.
func PackHashes(hashes []uint64) []byte {
	out := make([]byte, HashBytes*len(hashes))
	for i, h := range hashes {
		binary.LittleEndian.PutUint64(out[HashBytes*i:], h)
	}
	return out
}

// UnpackHashes reads packed block hashes back; it fails unless len(data) is a multiple of 8.
func UnpackHashes(data []byte) ([]uint64, error) {
	if len(data)%HashBytes != 0 {
		return nil, fmt.Errorf("%d bytes are not a whole number of %d-byte little-endian uint64 hashes", len(data), HashBytes)
	}
	out := make([]uint64, len(data)/HashBytes)
	for i := range out {
		out[i] = binary.LittleEndian.Uint64(data[HashBytes*i:])
	}
	return out, nil
}
