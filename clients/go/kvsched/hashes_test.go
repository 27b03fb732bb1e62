package kvsched_test

import (
	"bytes"
	"reflect"
	"testing"

	"kvsched/clients/go/kvsched"
)

func TestPackedHashesAreLittleEndianAndRoundTrip(t *testing.T) {
	hashes := []uint64{0x0102030405060708, ^uint64(0), 0, 1 << 63}
	packed := kvsched.PackHashes(hashes)
	want := []byte{8, 7, 6, 5, 4, 3, 2, 1, 255, 255, 255, 255, 255, 255, 255, 255,
		0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0x80}
	if !bytes.Equal(packed, want) {
		t.Fatalf("packed % x; want % x", packed, want)
	}
	back, err := kvsched.UnpackHashes(packed)
	if err != nil || !reflect.DeepEqual(back, hashes) {
		t.Fatalf("unpacked %v, %v; want %v", back, err, hashes)
	}
	if empty := kvsched.PackHashes(nil); len(empty) != 0 {
		t.Fatalf("no hashes packed to %d bytes", len(empty))
	}
	if _, err := kvsched.UnpackHashes(make([]byte, 9)); err == nil {
		t.Fatal("9 bytes unpacked without an error")
	}
}
